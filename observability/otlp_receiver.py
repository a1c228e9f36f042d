"""A small OTLP/HTTP trace receiver: decodes exported spans and keeps them in memory.

The tests use it as the collector of a real stack; ``python -m observability.trace_tree``
uses it to print each request's span tree without a Jaeger.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    events: list[str]
    links: list[tuple[str, str]]  # (trace_id, span_id)
    start_ns: int = 0
    end_ns: int = 0
    children: list = field(default_factory=list)
    resource: dict = field(default_factory=dict)  # the exporting service's attributes


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    """Listens on 127.0.0.1 (``port`` 0 picks one); ``spans`` grows as services export."""

    def __init__(self, port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.num_bytes = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.num_bytes += len(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _add(self, request) -> None:
        received = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = resource["service.name"]
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                        [e.name for e in s.events],
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        s.start_time_unix_nano, s.end_time_unix_nano, resource=resource))
        with self._lock:
            self.spans.extend(received)

    def wait_for(self, predicate, timeout: float = 15.0) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` is truthy; returns the spans then."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; received {len(spans)} spans: "
                                     f"{sorted({s.name for s in spans})}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
