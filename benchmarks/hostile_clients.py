"""Issue 14's load check: a well-behaved client under attack, and tenant fairness.

For each attack (benchmarks/attacks.py) a `folio serve` stack with API keys on and
default limits serves a victim tenant's 16-token streaming requests, one after another,
before the attack (unloaded) and while it runs; a watcher polls /health every 20 ms
throughout. The report gives the victim's p50/p99 TTFT unloaded and under attack, their
ratio (target: p99 within 2x), and the slowest /health answer (target: 100 ms). The
attacking client runs at ``--attacker-nice`` (default 10), standing in for a client on
another machine; ``--attacker-nice 0`` shares the CPU equally with the server.

Fairness: tenant A floods 64 heavy requests (512-token prompts that share no prefix,
128 tokens out) and tenant B sends 16-token requests one after another from 2 s in until
the flood ends; B's TTFT (p50, p90, slowest) against its unloaded median, under
`scheduler.policy: fcfs` and `fair` (target for fair: within 3x), and A's output rate.

    .venv/bin/python benchmarks/hostile_clients.py --json benchmarks/results/hostile_clients.json
    .venv/bin/python benchmarks/hostile_clients.py --attacks slowloris --no-fairness
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import attacks  # noqa: E402
from benchmarks.serve_stack import serving  # noqa: E402

VICTIM, ATTACKER = "sk-bench-victim-0123456789", "sk-bench-attacker-9876543210"
PROMPT = "Write one short sentence about the sea."
ATTACKS = ("bombs", "slowloris", "slow_bodies", "health_flood", "stop_ids")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def ttfts(url: str, key: str, num: int, prompt=PROMPT) -> list[float]:
    """``num`` sequential 16-token streaming requests; the time to each first token."""
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(num):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", headers=bearer(key), json={
                    "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
                    "ignore_eos": True}) as r:
                assert r.status == 200, f"victim got HTTP {r.status}"
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
            out.append(first)
    return out


async def watch_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(url + "/health") as r:
                await r.read()
                if r.status != 200:
                    latencies.append(float("inf"))
                    continue
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)


async def run_attack(url: str, name: str, num: int, attacker_nice: int) -> dict:
    """The victim unloaded, then while the attack runs in a process of its own (so that
    the attacker's client work never delays the victim's client) at nice
    ``attacker_nice``: a real attacker's client runs on its own machine, and on a
    2-core box its client-side work (building 4 MB bodies, 2,800 requests a second)
    would otherwise take the server's CPU and count as the server's weakness."""
    stop_watch, health = asyncio.Event(), []
    watcher = asyncio.ensure_future(watch_health(url, stop_watch, health))
    unloaded = await ttfts(url, VICTIM, num)
    attacker = await asyncio.create_subprocess_exec(
        "nice", "-n", str(attacker_nice), sys.executable,
        str(REPO / "benchmarks" / "attacks.py"), name, url, ATTACKER,
        stdout=asyncio.subprocess.PIPE)
    await asyncio.sleep(3.0)  # let the attack reach its steady state
    loaded = await ttfts(url, VICTIM, num)
    if attacker.returncode is None:
        attacker.terminate()
    out, _ = await asyncio.wait_for(attacker.communicate(), 120)
    done = int(out.strip() or -1)
    stop_watch.set()
    await watcher
    result = {"attack": name, "attack_count": done, "attacker_nice": attacker_nice,
              "ttft_unloaded_p50_s": statistics.median(unloaded),
              "ttft_unloaded_p99_s": percentile(unloaded, 0.99),
              "ttft_attacked_p50_s": statistics.median(loaded),
              "ttft_attacked_p99_s": percentile(loaded, 0.99),
              "health_max_s": max(health), "health_p99_s": percentile(health, 0.99),
              "health_samples": len(health)}
    result["ttft_p99_ratio"] = result["ttft_attacked_p99_s"] / result["ttft_unloaded_p99_s"]
    result["pass"] = result["ttft_p99_ratio"] <= 2.0 and result["health_max_s"] <= 0.1
    return result


async def run_fairness(url: str, num: int, tokenizer) -> dict:
    """B's TTFT unloaded (``num`` requests), then B's requests one after another from
    2 s into A's flood until it ends (both its prefill and its decode phase)."""
    ids = tokenizer.encode("The history of the sea " * 200)[:512]
    unloaded = await ttfts(url, VICTIM, num)
    t0 = time.perf_counter()
    flood = asyncio.ensure_future(attacks.heavy_tenant(url, bearer(ATTACKER), ids, 64, 128))
    await asyncio.sleep(2.0)
    loaded = []
    while not flood.done():
        loaded += await ttfts(url, VICTIM, 1)
    flood_tokens = await flood
    flood_s = time.perf_counter() - t0
    base = statistics.median(unloaded)
    return {"flood_s": flood_s, "flood_output_tok_s": flood_tokens / flood_s,
            "ttft_unloaded_p50_s": base, "num_loaded": len(loaded),
            "ttft_loaded_p50_s": statistics.median(loaded),
            "ttft_loaded_p90_s": percentile(loaded, 0.9),
            "ttft_loaded_max_s": max(loaded),
            "ratio_p50": statistics.median(loaded) / base,
            "ratio_p90": percentile(loaded, 0.9) / base,
            "ratio_max": max(loaded) / base}


def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", platform.processor()).strip(),
            "flags": [f for f in flags if f.startswith(("avx", "amx"))],
            "cpus": fields.get("CPU(s)", "").strip()}


def settings(args, policy: str = "fcfs", max_step_ms: float | None = None,
             fair_step_factor: float | None = None) -> dict:
    scheduler = {"policy": policy, "max_step_ms": max_step_ms}
    if fair_step_factor is not None:
        scheduler["fair_step_factor"] = fair_step_factor
    return {"model": {"dtype": args.dtype}, "api": {"api_keys": [VICTIM, ATTACKER]},
            "scheduler": scheduler, "observability": {"log_level": "warning"}}


def parse_policy(name: str) -> tuple[str, float | None, float | None]:
    """``fair``, ``fair:60`` (scheduler.max_step_ms) or ``fair@4`` (fair_step_factor)."""
    name, _, factor = name.partition("@")
    policy, _, max_step_ms = name.partition(":")
    return (policy, float(max_step_ms) if max_step_ms else None,
            float(factor) if factor else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-fairness", action="store_true")
    parser.add_argument("--attacker-nice", type=int, default=10,
                        help="nice value of the attacking client's process (0: equal)")
    parser.add_argument("--policies", default="fcfs,fair",
                        help="fairness part: policies to compare, each optionally with a "
                             "scheduler.max_step_ms (:ms) or fair_step_factor (@x), e.g. "
                             "fcfs,fair,fair@0,fair:150")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {"cpu": cpu_info(), "dtype": args.dtype, "attacks": [], "fairness": {}}
    with serving(settings(args)) as (url, _):
        for name in [a for a in args.attacks.split(",") if a]:
            result = asyncio.run(run_attack(url, name, args.num_requests,
                                                args.attacker_nice))
            report["attacks"].append(result)
            print(json.dumps(result), flush=True)
    if not args.no_fairness:
        from text.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_model_path("default")
        for i, name in enumerate(args.policies.split(",")):
            key = name if name not in report["fairness"] else f"{name}#{i + 1}"  # repeats
            with serving(settings(args, *parse_policy(name))) as (url, _):
                report["fairness"][key] = asyncio.run(run_fairness(url, 10, tokenizer))
            print(key, json.dumps(report["fairness"][key]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
