"""Speculative decoding as a benchmark client sees it: the server's spec-decode
counters (Folio's ``folio:spec_decode_*`` or vLLM's ``vllm:spec_decode_*``), read from
/metrics before and after a run, turned into an acceptance rate."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_PER_POS = "num_accepted_tokens_per_pos"


def parse_spec_counters(text: str) -> dict | None:
    """The spec-decode counters in a Prometheus text exposition (summed over labels but
    ``position``); None when the server exposes none."""
    found: dict = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # matched by sample name: TYPE lines vary
            name = sample.name.rpartition(":")[2]
            if not (name.startswith("spec_decode_") and name.endswith("_total")):
                continue
            name = name.removeprefix("spec_decode_").removesuffix("_total")
            if name == _PER_POS:
                pos = int(sample.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif name in _COUNTERS:
                found[name] = found.get(name, 0.0) + sample.value
    if not found:
        return None
    found[_PER_POS] = [per_pos[p] for p in sorted(per_pos)]
    return found


def acceptance_report(before: dict | None, after: dict | None) -> dict | None:
    """What the run did: draft tokens verified and accepted, the acceptance rate, the
    mean tokens per verified draft run (accepted + the model's own), per position."""
    if after is None:
        return None
    before = before or {k: 0.0 for k in _COUNTERS} | {_PER_POS: []}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}
    per_pos = [a - (before[_PER_POS][i] if i < len(before[_PER_POS]) else 0.0)
               for i, a in enumerate(after[_PER_POS])]
    drafts, proposed, accepted = (delta[k] for k in _COUNTERS)
    return {"num_drafts": int(drafts), "num_draft_tokens": int(proposed),
            "num_accepted_tokens": int(accepted),
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "accepted_per_position": [int(v) for v in per_pos]}
