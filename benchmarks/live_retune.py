"""What a live retune costs and how fast it lands, on `folio serve` with the default
model (two API processes):

- POST /admin/reload_config round trip for an applied change (scheduler.max_num_seqs
  flipped), and for an unchanged file;
- a file edit until both API processes' /admin/config show it (the file watch, 300 ms
  debounce included);
- a workload of concurrent streamed requests while the YAML is rewritten --edits
  times: requests lost (must be 0) and tokens served.

    .venv/bin/python benchmarks/live_retune.py --json benchmarks/results/live_retune.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.serve_stack import start_serve  # noqa: E402


def settings(socket_dir: str, max_num_seqs: int) -> dict:
    return {"model": {"path": "default", "max_model_len": 2048},
            "memory": {"kv_cache_bytes": 128 * 1024 ** 2},
            "scheduler": {"max_num_seqs": max_num_seqs},
            "observability": {"log_level": "warning"},
            "services": {"api_port": 0, "num_api_servers": 2, "socket_dir": socket_dir}}


async def admin(socket_dir: str, index: int, method: str, path: str) -> dict:
    import aiohttp
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(
            path=f"{socket_dir}/api-{index}.sock")) as s:
        async with s.request(method, "http://api" + path) as r:
            return await r.json()


async def measure(url: str, config: Path, socket_dir: str, num_edits: int,
                  num_requests: int) -> dict:
    import aiohttp
    out: dict = {}
    round_trips = {"applied": [], "unchanged": []}
    for i in range(10):
        config.write_text(yaml.safe_dump(settings(socket_dir, 16 + i % 2)))
        await asyncio.sleep(1.0)  # let the watch apply it first: this one is unchanged
        t0 = time.perf_counter()
        reply = await admin(socket_dir, i % 2, "POST", "/admin/reload_config")
        round_trips[reply["result"]].append(time.perf_counter() - t0)
        config.write_text(yaml.safe_dump(settings(socket_dir, 32 + i % 2)))
        t0 = time.perf_counter()  # may race the watch: counted under what it got
        reply = await admin(socket_dir, i % 2, "POST", "/admin/reload_config")
        round_trips[reply["result"]].append(time.perf_counter() - t0)
    out["reload_round_trip_ms"] = {k: {"n": len(v), "median": round(1e3 * statistics.median(v), 2),
                                       "max": round(1e3 * max(v), 2)}
                                   for k, v in round_trips.items() if v}
    watch = []
    for i in range(5):
        want = 48 + i
        config.write_text(yaml.safe_dump(settings(socket_dir, want)))
        t0 = time.perf_counter()
        while True:
            seen = [(await admin(socket_dir, j, "GET", "/admin/config"))
                    ["scheduler"]["max_num_seqs"] for j in (0, 1)]
            if seen == [want, want]:
                break
            await asyncio.sleep(0.01)
        watch.append(time.perf_counter() - t0)
    out["file_edit_to_both_api_processes_ms"] = {
        "median": round(1e3 * statistics.median(watch), 1), "max": round(1e3 * max(watch), 1)}

    async def one(session, n):
        body = {"prompt": "Count with me", "max_tokens": n, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url + "/v1/completions", json=body) as r:
            tokens = 0
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage": {' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return r.status, tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        load = [asyncio.create_task(one(session, 64)) for _ in range(num_requests)]
        for i in range(num_edits):
            config.write_text(yaml.safe_dump(settings(socket_dir, 2 + i % 15)))
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*load)
        elapsed = time.perf_counter() - t0
    out["under_load"] = {
        "requests": num_requests, "edits": num_edits,
        "lost": sum(1 for status, tokens in results if status != 200 or tokens != 64),
        "output_tokens": sum(t for _, t in results), "seconds": round(elapsed, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    socket_dir = tempfile.mkdtemp(prefix="folio-")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "folio.yaml"
        config.write_text(yaml.safe_dump(settings(socket_dir, 16)))
        proc, url = start_serve(config, Path(tmp) / "serve.out")
        try:
            result = asyncio.run(measure(url, config, socket_dir, args.edits, args.requests))
        finally:
            proc.terminate()
            proc.wait(120)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result["cpu"] = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                          if line.startswith("Model name")), "?")
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
