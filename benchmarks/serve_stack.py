"""Shared by the serving benchmarks: run `folio serve` on a settings tree, send a
workload of token-id prompts over HTTP, measure output throughput."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from observability.process_stats import command_line, cpu_seconds, descendants  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_READY = re.compile(r"API listening on (http://\S+)")


async def post_all(url: str, reqs, stream: bool) -> int:
    """Send every (prompt ids, max_tokens) request at once; the output tokens served."""
    import aiohttp

    async def one(session, ids, n):
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            if not stream:
                return (await r.json())["usage"]["completion_tokens"]
            tokens = 0
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage": {' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        return sum(await asyncio.gather(*(one(session, ids, n) for ids, n in reqs)))


def start_serve(config: Path, out: Path,
                timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`folio serve --config config` with its output in ``out``; (process, its URL) once
    the API listens. The caller stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "folio.cli", "serve", "--config",
                             str(config)], cwd=REPO, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _READY.search(out.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"folio serve exited {proc.returncode}:\n{out.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("folio serve did not start")


@contextlib.contextmanager
def serving(settings: dict):
    """`folio serve` on ``settings`` (a YAML tree) for the block; yields (url, pid)."""
    settings = {**settings, "services": {**settings.get("services", {}), "api_port": 0}}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "folio.yaml"
        config.write_text(yaml.safe_dump(settings))
        proc, url = start_serve(config, Path(tmp) / "serve.out")
        try:
            yield url, proc.pid
        finally:
            proc.terminate()
            proc.wait(60)


def served_model(url: str) -> str:
    """The base model's name as the stack serves it (requests must name it)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_served(settings: dict, reqs, stream: bool = False) -> dict:
    """Start a stack with ``settings`` (a YAML tree), warm it up, time the workload and
    measure each service's CPU seconds during it."""
    with serving(settings) as (url, pid):
        asyncio.run(post_all(url, reqs[:2], stream))  # warm-up
        children = {p: " ".join(command_line(p)[2:3]) for p in descendants(pid)}
        cpu0 = {p: cpu_seconds(p) for p in children}
        t0 = time.perf_counter()
        num_out = asyncio.run(post_all(url, reqs, stream))
        elapsed = time.perf_counter() - t0
        cpu = {children[p]: round(cpu_seconds(p) - cpu0[p], 2) for p in children}
    return {"seconds": elapsed, "output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "cpu_seconds": cpu,
            "total_cpu_seconds": round(sum(cpu.values()), 2)}
