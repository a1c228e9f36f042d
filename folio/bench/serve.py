"""`folio bench serve`: drive any OpenAI-compatible /v1/completions endpoint (Folio's
or another server's) with a synthetic workload and report what a client sees.

Arrivals are Poisson at ``request_rate`` (gamma-distributed gaps when ``burstiness`` is
not 1: below 1 burstier, above 1 steadier), or all at once when the rate is inf;
``max_concurrency`` caps requests in flight. Every request streams, so time to first
token and the gaps between tokens are measured at the client. When the server exposes
spec-decode counters at /metrics, the report has the run's acceptance rate.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from folio.bench.spec_metrics import acceptance_report, parse_spec_counters
from folio.bench.stats import RequestRecord, summarize
from folio.bench.workload import BenchRequest


@dataclass(slots=True)
class LoadSpec:
    """How requests arrive."""

    request_rate: float = float("inf")  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


async def _arrivals(requests: list[BenchRequest], spec: LoadSpec):
    rng = random.Random(spec.seed)
    for req in requests:
        yield req
        if spec.request_rate != float("inf"):
            shape = spec.burstiness
            await asyncio.sleep(rng.gammavariate(shape, 1.0 / (spec.request_rate * shape)))


# A pooled keep-alive connection the server already closed fails before any answer
# (some servers, llama.cpp's cpp-httplib among them, close them after a few requests):
# that is the client's connection handling, not a server failure, so the request is
# sent again on a connection of its own, never taken from the pool (at 32 clients the
# pool can hold several stale ones: retrying through it once failed four times running).
STALE_CONNECTION_RETRIES = 3


async def _one(session, url: str, model: str, req: BenchRequest, ignore_eos: bool,
               extra: dict) -> RequestRecord:
    import aiohttp
    record = RequestRecord(prompt_len=req.prompt_len)
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **({"ignore_eos": True} if ignore_eos else {}), **extra}
    start = time.perf_counter()
    for attempt in range(STALE_CONNECTION_RETRIES + 1):
        answered = []  # set once the server sent a status line: no retry after that
        try:
            if attempt == 0:
                return await _stream(session, url, body, record, start, answered)
            async with aiohttp.ClientSession(
                    timeout=session.timeout,
                    connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                return await _stream(fresh, url, body, record, start, answered)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if answered or attempt == STALE_CONNECTION_RETRIES:
                record.error = f"{type(e).__name__}: {e}"[:200]
                return record
            record.num_retries += 1
        except Exception as e:  # a benchmark records failures, it does not stop on them
            record.error = f"{type(e).__name__}: {e}"[:200]
            return record
    return record


async def _stream(session, url: str, body: dict, record: RequestRecord, start: float,
                  answered: list) -> RequestRecord:
    last = start
    chunks = 0
    async with session.post(url, json=body) as resp:
        answered.append(resp.status)
        if resp.status != 200:
            record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return record
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            payload = json.loads(line[6:])
            if payload.get("error"):
                record.error = str(payload["error"])[:200]
                return record
            if payload.get("usage"):
                record.output_len = payload["usage"]["completion_tokens"]
            if payload.get("choices") and payload["choices"][0].get("text"):
                now = time.perf_counter()
                if chunks == 0:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                chunks += 1
    record.e2e = time.perf_counter() - start
    record.output_len = record.output_len or chunks
    record.success = chunks > 0
    if not record.success:
        record.error = "no tokens streamed"
    return record


async def _spec_counters(session, base_url: str) -> dict | None:
    """The server's spec-decode counters, or None (none exposed, or /metrics refused)."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            return parse_spec_counters(await resp.text()) if resp.status == 200 else None
    except Exception:  # a server without /metrics still gets benchmarked
        return None


async def run_load(base_url: str, model: str, requests: list[BenchRequest], spec: LoadSpec,
                   ignore_eos: bool = True, extra: dict | None = None
                   ) -> tuple[list[RequestRecord], float, dict | None]:
    """Send the workload; (a record per request, wall seconds from first send to last,
    the server's speculative-decoding acceptance over the run or None)."""
    import aiohttp
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(spec.max_concurrency or len(requests) or 1)

    async def limited(session, req):
        async with limit:
            return await _one(session, url, model, req, ignore_eos, extra or {})

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await _spec_counters(session, base_url)
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(limited(session, req))
                 async for req in _arrivals(requests, spec)]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _spec_counters(session, base_url)
        return list(records), duration, acceptance_report(before, after)


def bench_serve(base_url: str, model: str, requests: list[BenchRequest], spec: LoadSpec,
                slo_ms: dict[str, float] | None = None, ignore_eos: bool = True,
                extra: dict | None = None) -> dict:
    """One run at one load: the report (see folio.bench.stats.summarize). ``extra``
    fields go into every request body (e.g. a server's own sampling options)."""
    records, duration, spec_decode = asyncio.run(run_load(base_url, model, requests, spec,
                                                          ignore_eos, extra))
    report = summarize(records, duration, slo_ms)
    if spec_decode is not None:
        report["spec_decode"] = spec_decode
    report["load"] = {"request_rate": spec.request_rate, "burstiness": spec.burstiness,
                      "max_concurrency": spec.max_concurrency}
    return report


def format_report(report: dict) -> str:
    lines = [f"requests: {report['completed']} completed, {report['failed']} failed "
             f"in {report['duration_s']:.1f}s",
             f"throughput: {report['request_throughput']:.2f} req/s, "
             f"input {report['input_throughput']:.1f} tok/s, "
             f"output {report['output_throughput']:.1f} tok/s"]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_ms", "E2E")):
        d = report[key]
        lines.append(f"{label:>5} ms: mean {d['mean']:.1f}  p50 {d['p50']:.1f}  "
                     f"p90 {d['p90']:.1f}  p99 {d['p99']:.1f}")
    if "goodput" in report:
        g = report["goodput"]
        lines.append(f"goodput: {g['request_goodput']:.2f} req/s meet {g['slo_ms']} "
                     f"({g['requests_meeting_slo']} requests)")
    if "spec_decode" in report:
        d = report["spec_decode"]
        lines.append(f"spec decode: acceptance rate {100 * d['acceptance_rate']:.1f}% "
                     f"({d['num_accepted_tokens']} of {d['num_draft_tokens']} draft tokens), "
                     f"mean acceptance length {d['mean_acceptance_length']:.2f}")
    if report["errors"]:
        lines.append(f"errors: {report['errors']}")
    return "\n".join(lines)


def plot_sweep(reports: list[dict], path: str) -> None:
    """Output throughput against p50/p99 end-to-end latency, one point per rate."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install -c constraints.txt "
                         "'folio[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["output_throughput"] for r in reports]
    for q in ("p50", "p99"):
        ax.plot(xs, [r["e2e_ms"][q] / 1000 for r in reports], marker="o", label=f"E2E {q}")
    for r in reports:
        ax.annotate(f"{r['load']['request_rate']:g}/s", (r["output_throughput"],
                                                         r["e2e_ms"]["p50"] / 1000))
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("end-to-end latency (s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
