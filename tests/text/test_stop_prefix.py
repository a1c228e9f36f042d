"""The stop strings' held-back suffix, fed piece by piece, against its definition."""
import random

import pytest

from text.stop_prefix import StopPrefixes, borders


def held_back(output: str, stops: list[str]) -> int:
    """The definition: the longest suffix of ``output`` that is a proper prefix of a stop."""
    return max((n for stop in stops for n in range(1, len(stop))
                if output.endswith(stop[:n])), default=0)


def test_borders():
    assert borders("abab") == [0, 0, 1, 2]
    assert borders("aaaa") == [0, 1, 2, 3]
    assert borders("abcab") == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("seed", range(40))
def test_fed_in_pieces_it_follows_the_definition(seed):
    rng = random.Random(seed)
    alphabet = "ab=" if seed % 2 else "abcZ="
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
             for _ in range(rng.randint(1, 4))]
    prefixes, output = StopPrefixes(stops), ""
    for _ in range(60):
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        output += piece
        assert prefixes.feed(piece) == held_back(output, stops), (stops, output)


def test_a_stop_built_to_stay_open_is_followed():
    # the probe's case: a 1,023-character run that one stop's prefix keeps matching
    stops = [chr(ord("A") + i) + "=" * 1023 for i in range(15)] + ["=" * 1023 + "Z"]
    prefixes, output = StopPrefixes(stops), ""
    for _ in range(40):
        output += "=" * 64
        assert prefixes.feed("=" * 64) == min(len(output), 1023)
    assert prefixes.feed("Y") == 0
