"""Print traces as span trees: an OTLP/HTTP receiver for when there is no Jaeger.

    python -m observability.trace_tree --port 4318
    folio serve --set observability.otlp_endpoint=http://127.0.0.1:4318

Each trace is printed once it has been quiet for ``--settle`` seconds: one line per span
(name, service, duration, the attributes that say most), children indented.
"""
from __future__ import annotations

import argparse
import sys
import time

from observability.otlp_receiver import OTLPReceiver, ReceivedSpan

_SHOWN = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
          "gen_ai.response.finish_reasons", "folio.num_tokens", "folio.num_steps",
          "folio.num_new_blocks", "folio.num_cached_tokens", "folio.batch_size",
          "folio.forward_seconds")


def format_tree(spans: list[ReceivedSpan]) -> str:
    """One trace (or several) as indented lines, children in start order."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else ""
        children.setdefault(parent, []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            shown = {k.split(".")[-1]: v for k, v in s.attributes.items() if k in _SHOWN}
            extra = " ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}"
                             for k, v in shown.items())
            events = f" events={s.events}" if s.events else ""
            links = f" links={len(s.links)}" if s.links else ""
            lines.append(f"{'  ' * depth}{s.name} [{s.service}] "
                         f"{(s.end_ns - s.start_ns) / 1e6:.1f} ms {extra}{events}{links}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m observability.trace_tree")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--settle", type=float, default=2.0,
                        help="print a trace after this many quiet seconds")
    args = parser.parse_args(argv)
    receiver = OTLPReceiver(args.port)
    print(f"receiving OTLP/HTTP traces on {receiver.url}", file=sys.stderr, flush=True)
    printed: set[str] = set()
    last_seen: dict[str, tuple[int, float]] = {}
    try:
        while True:
            time.sleep(0.5)
            by_trace: dict[str, list[ReceivedSpan]] = {}
            for s in list(receiver.spans):
                by_trace.setdefault(s.trace_id, []).append(s)
            now = time.monotonic()
            for trace_id, spans in by_trace.items():
                if trace_id in printed:
                    continue
                count, since = last_seen.get(trace_id, (-1, now))
                if count != len(spans):
                    last_seen[trace_id] = (len(spans), now)
                elif now - since >= args.settle:
                    print(f"trace {trace_id}\n{format_tree(spans)}\n", flush=True)
                    printed.add(trace_id)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
