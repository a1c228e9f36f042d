"""This API process's own Prometheus metrics, served at /metrics after the engine's.

The engine core's metrics are engine-wide and the same from every API process; these
are the process's own (with several API processes, each scrape sees the one that
answered it):

    folio:api_connections_closed_total{reason}   connections the server ended:
                                                 header_timeout, body_timeout, idle,
                                                 over_limit
    folio:api_open_connections                   client connections open now
    folio:api_buffered_body_bytes                request-body bytes held now
    folio:api_body_budget_refusals_total         requests refused 503 for that budget
    folio:api_body_rate_held_total               bodies held unread past their tenant's
                                                 rate (body_rate.py)
    folio:api_body_rate_refusals_total           bodies refused 429 for that rate
    folio:api_body_rate_invalid_total            bodies refused 400 as invalid, charged
                                                 INVALID_BODY_COST times their bytes
    folio:api_public_polls_held_total            keyless /health or /metrics polls held
                                                 for their connection's pace
                                                 (public_pacing.py)

Values are read from the ConnectionGuard, the BodyBudget, the BodyRate and the
PublicPacing at scrape time, so the hot paths only bump plain integers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from observability.metrics import PREFIX
from services.api.body_budget import BodyBudget
from services.api.body_rate import BodyRate
from services.api.connection_guard import CLOSE_REASONS, ConnectionGuard
from services.api.public_pacing import PublicPacing


class _Collector:
    def __init__(self, guard: ConnectionGuard, budget: BodyBudget, rate: BodyRate,
                 pacing: PublicPacing):
        self.guard, self.budget, self.rate, self.pacing = guard, budget, rate, pacing

    def collect(self):
        closed = CounterMetricFamily(PREFIX + "api_connections_closed",
                                     "Client connections the API process ended, by reason",
                                     labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], self.guard.num_closed[reason])
        yield closed
        yield GaugeMetricFamily(PREFIX + "api_open_connections",
                                "Client connections open in this API process",
                                value=self.guard.num_open)
        yield GaugeMetricFamily(PREFIX + "api_buffered_body_bytes",
                                "Request-body bytes this API process holds now",
                                value=self.budget.num_bytes)
        for name, doc, value in (
                ("api_body_budget_refusals",
                 "Requests refused (503) because the body budget was spent",
                 self.budget.num_refused),
                ("api_body_rate_held",
                 "Request bodies held unread until their tenant's body rate covered them",
                 self.rate.num_held),
                ("api_body_rate_refusals",
                 "Requests refused (429) past their tenant's body rate",
                 self.rate.num_refused),
                ("api_body_rate_invalid",
                 "Request bodies refused as invalid (400), charged more of their "
                 "tenant's body rate",
                 self.rate.num_invalid),
                ("api_public_polls_held",
                 "Keyless /health or /metrics requests held for their connection's pace",
                 self.pacing.num_held)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)

class APIMetrics:
    """The registry of this API process's metrics; ``render()`` gives the text."""

    def __init__(self, guard: ConnectionGuard, budget: BodyBudget, rate: BodyRate,
                 pacing: PublicPacing):
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(guard, budget, rate, pacing))

    def render(self) -> str:
        return generate_latest(self.registry).decode()
