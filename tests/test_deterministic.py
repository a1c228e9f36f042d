"""Deterministic mode on a tiny Llama, float32 and bfloat16: the seeded request's tokens
and logprobs are bitwise those of its alone run in a batch of 32, at chunk sizes 16 and
2048, from the prefix cache and after preemption (tests/determinism_scenarios.py). The
default mode's differences are printed; what it must still keep is asserted."""
import math

import pytest

from tests.determinism_scenarios import SCENARIOS, differences, run_scenarios


def make(make_tiny_llm, dtype, deterministic):
    def build(**overrides):
        overrides.setdefault("num_blocks", 512)
        return make_tiny_llm(dtype=dtype, **{"worker.deterministic": deterministic},
                             **overrides)
    return build


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_is_bitwise_batch_invariant(make_tiny_llm, dtype):
    alone, found = run_scenarios(make(make_tiny_llm, dtype, True))
    assert len(alone.token_ids) == 40 and set(found) == set(SCENARIOS)
    assert differences(alone, found) == {name: None for name in SCENARIOS}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_mode_report(make_tiny_llm, dtype, capsys):
    alone, found = run_scenarios(make(make_tiny_llm, dtype, False))
    report = differences(alone, found)
    with capsys.disabled():
        print(f"\ndefault mode, tiny Llama, {dtype}: first differing token per scenario "
              f"(None = bitwise identical): {report}")
    # What the default mode keeps: until the first differing token, ids are equal and
    # the logprobs differ only by rounding.
    for name, o in found.items():
        n = report[name] if report[name] is not None else len(o.token_ids)
        assert o.token_ids[:n] == alone.token_ids[:n]
        tol = 1e-3 if dtype == "float32" else 0.1
        assert all(math.isclose(a, b, abs_tol=tol)
                   for a, b in zip(o.logprobs[:n + 1], alone.logprobs[:n + 1])), name
