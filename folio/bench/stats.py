"""Turn per-request timings into the serving report: throughput, latency percentiles
(TTFT, TPOT, ITL, end-to-end) and goodput under latency targets."""
from __future__ import annotations

from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one request measured; times in seconds from its own start."""

    prompt_len: int
    success: bool = False
    error: str | None = None
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    num_retries: int = 0  # sends again after a stale pooled connection (client side)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean and percentiles, in milliseconds by default."""
    if not values:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    return {"mean": sum(values) / len(values) * scale,
            **{f"p{q}": percentile(values, q) * scale for q in PERCENTILES}}


def meets(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """True when a successful request is within every latency target (milliseconds)."""
    if not record.success:
        return False
    measured = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(measured[k] * 1000 <= v for k, v in slo_ms.items())


def summarize(records: list[RequestRecord], duration: float,
              slo_ms: dict[str, float] | None = None) -> dict:
    """The report of one run of ``duration`` seconds."""
    ok = [r for r in records if r.success]
    report = {
        "duration_s": duration,
        "num_requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "client_retries": sum(r.num_retries for r in records),
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.prompt_len for r in ok) / duration,
        "output_throughput": sum(r.output_len for r in ok) / duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok]),
    }
    if slo_ms:
        good = sum(meets(r, slo_ms) for r in records)
        report["goodput"] = {"slo_ms": slo_ms, "requests_meeting_slo": good,
                             "request_goodput": good / duration}
    return report
