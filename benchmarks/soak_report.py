"""The soak's report (benchmarks/soak.py): what failed, latency per quarter of the run,
RSS of each process over time, the engine's state at the end, and a verdict."""
from __future__ import annotations

import json

from folio.bench.stats import distribution

# Memory counts as flat when no process grew by more than this from the first quarter's
# mean RSS to the last quarter's: allocator and cache warm-up stay well inside it.
RSS_GROWTH_LIMIT_MB = 32.0
RSS_GROWTH_LIMIT_FRACTION = 0.10


async def health(base_url: str) -> dict:
    """The API's /health body ({} when it does not answer 200)."""
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(base_url + "/health") as r:
                return await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError):
        return {}


def _quarters(results: list[dict], duration: float) -> list[dict]:
    out = []
    for q in range(4):
        lo, hi = duration * q / 4, duration * (q + 1) / 4
        ok = [r["record"] for r in results
              if r["kind"] == "normal" and r["record"].success and lo <= r["start_s"] < hi]
        out.append({"quarter": q + 1, "completed": len(ok),
                    "ttft_ms": distribution([r.ttft for r in ok]),
                    "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
                    "e2e_ms": distribution([r.e2e for r in ok])})
    return out


def _rss(samples: list[dict], duration: float) -> dict:
    names = sorted({n for s in samples for n in s["rss_mb"]})
    out = {}
    for name in names:
        series = [(s["t"], s["rss_mb"].get(name, 0.0)) for s in samples]
        first = [mb for t, mb in series if t < duration / 4] or [series[0][1]]
        last = [mb for t, mb in series if t >= duration * 3 / 4] or [series[-1][1]]
        q1, q4 = sum(first) / len(first), sum(last) / len(last)
        out[name] = {"first_mb": series[0][1], "last_mb": series[-1][1],
                     "max_mb": max(mb for _, mb in series), "q1_mean_mb": round(q1, 1),
                     "q4_mean_mb": round(q4, 1), "growth_mb": round(q4 - q1, 1),
                     "flat": q4 - q1 <= max(RSS_GROWTH_LIMIT_MB,
                                            RSS_GROWTH_LIMIT_FRACTION * q1)}
    return out


VALID_KINDS = ("normal", "disconnect")  # requests the server must serve (no 5xx)


def summarize_soak(results: list[dict], samples: list[dict], final: dict, args: dict,
                   saturation: float | None) -> dict:
    """The JSON report; ``verdict.pass`` is what the soak's exit status follows."""
    duration = args["duration_s"]
    by_kind = {k: [r for r in results if r["kind"] == k]
               for k in ("normal", "disconnect", "invalid", "slow", "bomb", "oversized")}
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    num_5xx = sum(1 for r in results if r["status"] >= 500 and r["kind"] in VALID_KINDS)
    stream_errors = [r["record"].error for r in results
                     if r["kind"] in VALID_KINDS and r["status"] == 200 and r["record"].error]
    failed = [r["record"].error for r in by_kind["normal"] if not r["record"].success]
    quarters = _quarters(results, duration)
    rss = _rss(samples, duration)
    clean = (final.get("num_requests") == 0 and final.get("num_waiting") == 0
             and final.get("num_referenced_blocks") == 0
             and final.get("num_free_blocks") == final.get("num_blocks"))
    verdict = {"zero_5xx": num_5xx == 0 and not stream_errors,
               "every_valid_request_completed": not failed,
               "invalid_requests_got_4xx": all(400 <= r["status"] < 500
                                               for r in by_kind["invalid"]),
               "adversarial_refused": all(400 <= r["status"] < 500 for k in
                                          ("slow", "bomb", "oversized") for r in by_kind[k]),
               "engine_clean_at_end": clean,
               "memory_flat": all(p["flat"] for p in rss.values())}
    verdict["pass"] = all(verdict.values())
    first, last = quarters[0], quarters[-1]
    return {
        "settings": dict(args),
        "saturation_req_per_s": saturation, "rate_req_per_s": args["rate"],
        "num_requests": {k: len(v) for k, v in by_kind.items()}, "statuses": statuses,
        "num_5xx": num_5xx, "stream_errors": stream_errors[:5],
        "failed_valid_requests": len(failed), "failures": sorted(set(failed))[:5],
        "quarters": quarters,
        "p99_last_over_first": {k: (last[k]["p99"] / first[k]["p99"]
                                    if first[k]["p99"] else None)
                                for k in ("ttft_ms", "tpot_ms", "e2e_ms")},
        "rss": rss, "rss_timeline": samples, "final_engine": final, "verdict": verdict}


def markdown(report: dict) -> str:
    """A readable summary of the JSON report."""
    s, v = report["settings"], report["verdict"]
    saturation = report["saturation_req_per_s"]
    how = (f"{s['load']:.0%} of a measured saturation of {saturation:.2f} req/s"
           if saturation else "rate given")
    lines = [f"# Soak: {s['duration_s']:.0f} s at {report['rate_req_per_s']:.2f} req/s "
             f"({how})", "", f"Model `{s['model']}` ({s['dtype']}), chat-shaped lengths around "
             f"{s['input_len']} in / {s['output_len']} out, "
             f"{s['disconnect_fraction']:.0%} disconnects, {s['invalid_fraction']:.0%} invalid, "
             f"{s.get('slow_fraction', 0):.0%} slow clients, {s.get('bomb_fraction', 0):.0%} "
             f"tokenizer bombs, {s.get('oversized_fraction', 0):.0%} oversized parameters"
             + (f", settings {s['set']}" if s["set"] else "") + ".", "",
             f"Requests: {json.dumps(report['num_requests'])}; HTTP statuses "
             f"{json.dumps(report['statuses'])}; 5xx: **{report['num_5xx']}**; "
             f"stream error events: {len(report['stream_errors'])}; failed valid requests: "
             f"{report['failed_valid_requests']}.", "",
             "| quarter | completed | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "E2E p50 / p99 ms |", "|---|---|---|---|---|"]
    for q in report["quarters"]:
        lines.append(f"| Q{q['quarter']} | {q['completed']} | " + " | ".join(
            f"{q[k]['p50']:.0f} / {q[k]['p99']:.0f}" for k in ("ttft_ms", "tpot_ms",
                                                               "e2e_ms")) + " |")
    ratios = report["p99_last_over_first"]
    lines += ["", "p99 last quarter / first quarter: " + ", ".join(
        f"{k[:-3].upper()} {r:.2f}x" for k, r in ratios.items() if r is not None), "",
        "| process | RSS first MB | Q1 mean | Q4 mean | growth | max | flat |",
        "|---|---|---|---|---|---|---|"]
    for name, p in report["rss"].items():
        lines.append(f"| {name} | {p['first_mb']:.0f} | {p['q1_mean_mb']:.0f} | "
                     f"{p['q4_mean_mb']:.0f} | {p['growth_mb']:+.1f} | {p['max_mb']:.0f} | "
                     f"{'yes' if p['flat'] else 'NO'} |")
    f = {k: int(v) for k, v in report["final_engine"].items() if isinstance(v, float)}
    lines += ["", f"At the end: {f.get('num_requests')} requests in the engine, "
              f"{f.get('num_referenced_blocks')} KV blocks referenced, "
              f"{f.get('num_free_blocks')} of {f.get('num_blocks')} blocks free.", "",
              "Verdict: " + ", ".join(f"{k} {'yes' if ok else 'NO'}"
                                      for k, ok in v.items() if k != "pass")
              + f" → **{'PASS' if v['pass'] else 'FAIL'}**", ""]
    return "\n".join(lines)
