"""Synthetic benchmark workloads: prompt and output lengths from a distribution, and
prompts made of real vocabulary so that any server's tokenizer sees ordinary text.

    fixed          every request input_len / output_len
    uniform        lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]
    chat           long-tailed (log-normal) lengths around input_len / output_len, like
                   conversation logs: most requests short, a few very long
    shared-prefix  one system prompt of prefix_len tokens before every request's own
                   input_len tokens (prefix caching's best case)
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

DATASETS = ("fixed", "uniform", "chat", "shared-prefix")


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload: its prompt text and the lengths it was built for."""

    prompt: str
    prompt_len: int  # tokens, by the tokenizer that built it
    output_len: int


def _lengths(dataset: str, n: int, input_len: int, output_len: int, range_ratio: float,
             rng: random.Random) -> list[tuple[int, int]]:
    if dataset == "uniform":
        def draw(mean):
            return rng.randint(max(1, int(mean * (1 - range_ratio))),
                               max(1, int(mean * (1 + range_ratio))))
        return [(draw(input_len), draw(output_len)) for _ in range(n)]
    if dataset == "chat":
        def draw(median, cap):  # sigma 1: the 90th percentile is ~3.6x the median
            return max(4, min(cap, int(rng.lognormvariate(math.log(median), 1.0))))
        return [(draw(input_len, 8 * input_len), draw(output_len, 8 * output_len))
                for _ in range(n)]
    return [(input_len, output_len)] * n


def make_workload(tokenizer, dataset: str, num_requests: int, input_len: int,
                  output_len: int, range_ratio: float = 0.5, prefix_len: int = 0,
                  seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` requests; ``tokenizer`` (Folio's) turns random ids into text."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    rng = random.Random(seed)
    low = 256  # skip special and byte tokens: ordinary words only
    vocab = tokenizer.vocab_size

    def text(num_tokens: int) -> str:
        return tokenizer.decode([rng.randrange(low, vocab) for _ in range(num_tokens)])

    prefix = text(prefix_len) if dataset == "shared-prefix" and prefix_len else ""
    requests = []
    for n_in, n_out in _lengths(dataset, num_requests, input_len, output_len, range_ratio,
                                rng):
        prompt = prefix + text(n_in)
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), n_out))
    return requests
