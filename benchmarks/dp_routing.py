"""Data-parallel routing figures for benchmarks/scale_out.py: the same shared-prefix
workload against `folio serve` with ``parallel.data_parallel_size`` 2 under each routing
policy, one stack after the other in one run.

Workload (fixed seed): 8 prefixes of 1,000 random tokens, 8 requests each with its own
8-token tail (64 requests), greedy, ``max_tokens`` tokens each. The first request of
each prefix goes first, one at a time; the other 56 follow in a shuffled order, at
most ``concurrency`` at once. Read from /metrics (the replicas' sum): prompt tokens
computed (prompt tokens less prefix-cache hits) and each replica's share; timed:
requests and generated tokens per second over the whole workload.
"""
from __future__ import annotations

import asyncio
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.serve_stack import start_serve

NUM_PREFIXES, PREFIX_LEN, SUFFIX_LEN, PER_PREFIX = 8, 1000, 8, 8


def workload(seed: int = 0) -> list[list[int]]:
    """64 prompts: 8 per shared 1,000-token prefix, each with its own 8-token tail; the
    first of each prefix comes first, then the others in a shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)]
                for _ in range(NUM_PREFIXES)]
    order = [p for _ in range(PER_PREFIX - 1) for p in range(NUM_PREFIXES)]
    rng.shuffle(order)
    return [prefixes[p] + [rng.randrange(100, 40000) for _ in range(SUFFIX_LEN)]
            for p in list(range(NUM_PREFIXES)) + order]


def _start(config: dict, folder: Path) -> tuple[subprocess.Popen, str]:
    path = folder / "folio.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_serve(path, folder / "serve.out")


def _metric(text: str, name: str, replica: str) -> float:
    pattern = re.compile(rf'^\w+:{name}\{{.*replica="{replica}".*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


async def _drive(url: str, prompts: list[list[int]], model: str, max_tokens: int,
                 concurrency: int) -> tuple[list[str], float, str]:
    import aiohttp
    gate = asyncio.Semaphore(concurrency)

    async def one(s, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        async with gate, s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {await r.text()}")
            return (await r.json())["choices"][0]["text"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        texts = [await one(s, p) for p in prompts[:NUM_PREFIXES]]
        texts += await asyncio.gather(*(one(s, p) for p in prompts[NUM_PREFIXES:]))
        seconds = time.perf_counter() - t0
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    return texts, seconds, metrics


def run_policy(policy: str, args) -> dict:
    config = {"model": {"path": args.model, "tokenizer": args.tokenizer, "dtype": args.dtype,
                        "max_model_len": 1024, "served_model_name": "bench"},
              "memory": {"num_blocks": args.num_blocks},
              "worker": {"num_threads": args.threads},
              "parallel": {"data_parallel_size": 2, "routing": policy},
              "observability": {"log_level": "warning"},
              "services": {"api_port": 0, "startup_timeout_s": 600}}
    prompts = workload(args.seed)
    with tempfile.TemporaryDirectory(prefix="folio-dp-") as folder:
        proc, url = _start(config, Path(folder))
        try:
            texts, seconds, metrics = asyncio.run(_drive(url, prompts, "bench",
                                                         args.max_tokens, args.concurrency))
        finally:
            proc.terminate()
            proc.wait(120)

    def computed(replica: str) -> int:
        return int(_metric(metrics, "prompt_tokens_total", replica)
                   - _metric(metrics, "prefix_cache_hits_total", replica))
    return {"routing": policy, "prompt_tokens": int(_metric(metrics, "prompt_tokens_total", "all")),
            "prompt_tokens_computed": computed("all"),
            "prompt_tokens_computed_per_replica": [computed("0"), computed("1")],
            "seconds": round(seconds, 2),
            "requests_per_s": round(len(prompts) / seconds, 2),
            "output_tokens_per_s": round(len(prompts) * args.max_tokens / seconds, 1),
            "texts": texts}


def run_all(args) -> list[dict]:
    """Every policy in ``args.policies``; adds each one's ratio to round_robin's
    computed prompt tokens and whether its texts equal the first policy's."""
    results = [run_policy(p, args) for p in args.policies.split(",")]
    base = results[0]["texts"]
    rr = next((r for r in results if r["routing"] == "round_robin"), None)
    for r in results:
        r["same_texts_as_" + results[0]["routing"]] = r.pop("texts") == base
        if rr is not None:
            r["round_robin_computed_over_this"] = round(
                rr["prompt_tokens_computed"] / r["prompt_tokens_computed"], 2)
    return results
