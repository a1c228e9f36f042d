"""Does ``tokenizers`` release the GIL while it encodes? (services/api/tokenizer_pool.py)

A thread encodes a long digit string (SmolLM2 splits every digit: the slowest text per
character) while the main thread counts loop iterations; the main thread's rate, as a
share of its rate alone, says how much of the GIL the encoding thread left it. Each
entry point of the default model's tokenizer is measured: ``encode``, ``encode_batch``
and Folio's ``Tokenizer.encode``.

    .venv/bin/python benchmarks/tokenizer_gil.py --mb 1
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from text.tokenizer import Tokenizer  # noqa: E402


def loop_rate(seconds: float) -> float:
    """Main-thread loop iterations per second with nothing else running."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n / seconds


def measure(work) -> tuple[float, float, float]:
    """(seconds of ``work`` in a thread, main-thread loop rate meanwhile, longest
    main-thread stall in seconds)."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work(), done.set()))
    n, longest = 0, 0.0
    start = last = time.perf_counter()
    thread.start()
    while not done.is_set():
        n += 1
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    seconds = time.perf_counter() - start
    return seconds, n / seconds, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=1.0, help="megabytes of digits")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_model_path("default")
    text = "1" * int(args.mb * 2 ** 20)
    backend = tokenizer.backend
    alone = loop_rate(1.0)
    print(f"main-thread loop alone: {alone:,.0f}/s; text: {len(text):,} digits")
    for name, work in [("backend.encode", lambda: backend.encode(text)),
                       ("backend.encode_batch", lambda: backend.encode_batch([text])),
                       ("Tokenizer.encode", lambda: tokenizer.encode(text))]:
        seconds, rate, stall = measure(work)
        print(f"{name:22s} {seconds:5.2f} s; main thread meanwhile {rate:12,.0f}/s "
              f"({100 * rate / alone:5.1f}% of alone), longest stall {stall * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
