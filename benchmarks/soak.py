"""Soak: steady Poisson traffic through `folio serve` for a long while, looking for leaks
and drift rather than speed.

Traffic runs at --load (default 0.7) of the saturated request throughput, which is
measured first with a closed loop at --saturation-concurrency (or pass --rate).
Requests have mixed lengths (`folio bench serve`'s "chat" workload), stream, and
ignore EOS; --disconnect-fraction of the clients hang up at a random token and
--invalid-fraction send a request the API must refuse (4xx). An adversarial mix rides
along (benchmarks/attacks.py): --slow-fraction clients trickle a body a byte a second
(the server must close them), --bomb-fraction send 4 MB tokenizer bombs and
--oversized-fraction send parameters as large as the body holds (both must get a 4xx
at once). The report: 5xx count
(must be 0), TTFT/TPOT/E2E percentiles per quarter of the run (first vs last), RSS of
every service process over time (it should stay flat), and the engine's gauges at the
end (no request left, no KV block in use). JSON and markdown go to benchmarks/results/.

    .venv/bin/python benchmarks/soak.py --duration-s 1200          # the real soak
    .venv/bin/python benchmarks/soak.py --duration-s 90 --saturation-s 20 \\
        --name soak_short                                           # a quick check
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import attacks  # noqa: E402
from benchmarks.serve_stack import serving  # noqa: E402
from config.loader import parse_set_overrides  # noqa: E402
from benchmarks.soak_report import health, markdown, summarize_soak  # noqa: E402
from folio.bench.stats import RequestRecord  # noqa: E402
from folio.bench.workload import make_workload  # noqa: E402
from observability.process_stats import command_line, descendants, rss_bytes  # noqa: E402
from text.tokenizer import Tokenizer  # noqa: E402

INVALID_BODIES = [{"prompt": "x", "max_tokens": 0}, {"prompt": ""},
                  {"prompt": "x", "temperature": -1}, {"model": "no-such-model", "prompt": "x"},
                  {"prompt": "x", "stream_options": {"include_usage": True}}]


async def _stream(session, url, body, record: RequestRecord, drop_at: int | None) -> int:
    """One streaming request; returns its HTTP status. Hangs up after ``drop_at``
    chunks when given (the record then stays unsuccessful, as a client that left)."""
    start = last = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            record.error = f"HTTP {resp.status}"
            return resp.status
        chunks = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                payload = json.loads(line[6:])
                if payload.get("error"):  # the stream ended with an error event
                    record.error = str(payload["error"])[:200]
                    return resp.status
                if payload.get("usage"):
                    record.output_len = payload["usage"]["completion_tokens"]
                if payload.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    if drop_at is not None and chunks >= drop_at:
                        resp.close()
                        return 200
        record.e2e = time.perf_counter() - start
        record.success = chunks > 0 and drop_at is None
        return 200


ADVERSARIAL = ("slow", "bomb", "oversized")
# how a slow client ended → the status it stands for (408: the server closed it)
_SLOW_STATUS = {"closed by server": 408, "held": 0, "refused": 503}


async def _adversarial(session, base_url, kind: str, rng: random.Random) -> int:
    if kind == "slow":
        return _SLOW_STATUS[await attacks.one_slow_client(base_url, hold_s=300)]
    if kind == "bomb":
        return await attacks.one_bomb(session, base_url, {}, rng)
    return await attacks.one_oversized(session, base_url, {}, 49152)


def _kind(draw: float, args) -> str:
    for kind, fraction in (("invalid", args.invalid_fraction),
                           ("disconnect", args.disconnect_fraction),
                           ("slow", args.slow_fraction), ("bomb", args.bomb_fraction),
                           ("oversized", args.oversized_fraction)):
        if draw < fraction:
            return kind
        draw -= fraction
    return "normal"


async def _one(session, base_url, model, req, kind: str, rng: random.Random) -> dict:
    url = base_url + "/v1/completions"
    record = RequestRecord(prompt_len=req.prompt_len)
    if kind in ADVERSARIAL:
        try:
            status = await _adversarial(session, base_url, kind, rng)
        except Exception as e:  # noqa: BLE001 - a dropped connection is a refusal too
            record.error, status = f"{type(e).__name__}"[:200], 499
        return {"kind": kind, "status": status, "record": record}
    if kind == "invalid":
        async with session.post(url, json={"model": model,
                                           **rng.choice(INVALID_BODIES)}) as resp:
            return {"kind": kind, "status": resp.status, "record": record}
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    drop_at = rng.randint(1, max(1, req.output_len - 1)) if kind == "disconnect" else None
    try:
        status = await _stream(session, url, body, record, drop_at)
    except Exception as e:  # noqa: BLE001 - a soak records failures, it does not stop
        record.error, status = f"{type(e).__name__}: {e}"[:200], 0
    return {"kind": kind, "status": status, "record": record}


def _process_names(pid: int) -> dict[int, str]:
    names = {pid: "supervisor"}
    for child in descendants(pid):
        argv = command_line(child)
        module = argv[argv.index("-m") + 1] if "-m" in argv else argv[-1:]
        name = {"services.worker_service": "worker",
                "services.engine_core_service": "engine-core"}.get(module, module)
        if module == "services.api":
            name = f"api-{argv[argv.index('--index') + 1]}"
        names[child] = str(name)
    return names


async def _sample(base_url, pid, interval, stop: asyncio.Event, t0, samples: list) -> None:
    """RSS of every process and the engine's gauges, every ``interval`` seconds."""
    names = _process_names(pid)
    while True:
        gauges = (await health(base_url)).get("engine", {})
        samples.append({"t": round(time.perf_counter() - t0, 1),
                        "rss_mb": {n: round(rss_bytes(p) / 2**20, 1) for p, n in names.items()},
                        "num_running": gauges.get("num_running"),
                        "num_waiting": gauges.get("num_waiting"),
                        "kv_cache_usage": gauges.get("kv_cache_usage")})
        print(f"t={samples[-1]['t']:.0f}s running {gauges.get('num_running')} waiting "
              f"{gauges.get('num_waiting')} RSS MB {samples[-1]['rss_mb']}", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass


async def soak(base_url, pid, model, requests, args) -> tuple[list[dict], list[dict]]:
    """Poisson arrivals at ``args.rate`` for ``args.duration_s``; (results, samples)."""
    rng = random.Random(args.seed)
    stop, samples, tasks, starts = asyncio.Event(), [], [], []
    t0 = time.perf_counter()
    sampler = asyncio.ensure_future(_sample(base_url, pid, args.sample_interval_s, stop,
                                            t0, samples))
    async with _session() as session:
        while (now := time.perf_counter() - t0) < args.duration_s:
            kind = _kind(rng.random(), args)
            tasks.append(asyncio.ensure_future(_one(session, base_url, model,
                                                    rng.choice(requests), kind,
                                                    random.Random(rng.random()))))
            starts.append(now)
            await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
    for start, result in zip(starts, results):
        result["start_s"] = start
    stop.set()
    await sampler
    return results, samples


async def _wait_clean(base_url, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        gauges = (await health(base_url)).get("engine", {})
        if (gauges.get("num_requests") == 0 and gauges.get("num_referenced_blocks") == 0
                and gauges.get("num_waiting") == 0) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.5)


def _settings(args) -> dict:
    settings = {"model": {"path": args.model, "tokenizer": args.tokenizer,
                          "dtype": args.dtype, "max_model_len": args.max_model_len},
                "memory": {"kv_cache_bytes": args.kv_cache_bytes},
                "observability": {"log_level": "warning"}}
    for key, value in parse_set_overrides(args.set).items():
        section, _, name = key.partition(".")
        settings.setdefault(section, {})[name] = value
    return settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=1200)
    p.add_argument("--rate", type=float, default=None, help="req/s; default: measured")
    p.add_argument("--load", type=float, default=0.7, help="fraction of saturation")
    p.add_argument("--saturation-s", type=float, default=60)
    p.add_argument("--saturation-concurrency", type=int, default=32)
    p.add_argument("--disconnect-fraction", type=float, default=0.05)
    p.add_argument("--invalid-fraction", type=float, default=0.01)
    p.add_argument("--slow-fraction", type=float, default=0.05)
    p.add_argument("--bomb-fraction", type=float, default=0.01)
    p.add_argument("--oversized-fraction", type=float, default=0.01)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default="default")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=1024 ** 3)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--sample-interval-s", type=float, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="soak", help="results/<name>.json and .md")
    return p.parse_args(argv)


async def _saturation(url, model, requests, args) -> float:
    """Completed requests per second of a closed loop over ``saturation_s``: each of
    ``saturation_concurrency`` clients sends its next request when its last one ends."""
    rng = random.Random(args.seed + 1)
    deadline = time.perf_counter() + args.saturation_s
    num_done = 0
    async with _session() as session:
        async def client():
            nonlocal num_done
            while time.perf_counter() < deadline:
                result = await _one(session, url, model, rng.choice(requests), "normal", rng)
                num_done += result["record"].success

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.saturation_concurrency)))
        return num_done / (time.perf_counter() - t0)


def _session():
    import aiohttp
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                 connector=aiohttp.TCPConnector(limit=0))


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the stack is drained
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tokenizer = Tokenizer.from_model_path(args.tokenizer or args.model)
    requests = make_workload(tokenizer, "chat", 512, args.input_len, args.output_len,
                             seed=args.seed)
    with serving(_settings(args)) as (url, pid):
        with urllib.request.urlopen(url + "/v1/models") as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        saturation = None
        if args.rate is None:
            saturation = asyncio.run(_saturation(url, model, requests, args))
            args.rate = args.load * saturation
            print(f"saturation: {saturation:.2f} req/s; soaking at {args.rate:.2f} req/s",
                  flush=True)
        results, samples = asyncio.run(soak(url, pid, model, requests, args))
        final = asyncio.run(_wait_clean(url))
    report = summarize_soak(results, samples, final, vars(args), saturation)
    out = REPO / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
