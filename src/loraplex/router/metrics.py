"""The router's own Prometheus series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.picks = Counter(
            "loraplex_router_picks_total",
            "Routing decisions by reason",
            ["reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "loraplex_router_retries_total",
            "Requests retried on another worker",
            registry=self.registry,
        )
        self.healthy = Gauge(
            "loraplex_router_worker_healthy",
            "1 while the worker passes its health checks",
            ["worker"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "loraplex_router_worker_in_flight",
            "Requests proxied to the worker and not done",
            ["worker"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "loraplex_router_tenant_waiting",
            "Requests of the tenant waiting at the router for a worker with room",
            ["tenant"],
            registry=self.registry,
        )
        self.granted = Counter(
            "loraplex_router_tenant_granted_total",
            "Requests of the tenant that waited at the router and were sent on",
            ["tenant"],
            registry=self.registry,
        )
        self.held_back = Counter(
            "loraplex_router_tenant_held_back_total",
            "Requests of the tenant, over its fair share, that waited at the router while the free "
            "places were kept for other tenants' next requests",
            ["tenant"],
            registry=self.registry,
        )
        self.misconfigured = Gauge(
            "loraplex_router_worker_misconfigured",
            "1 while the worker's reported base model or max rank does not match its pool",
            ["worker", "pool"],
            registry=self.registry,
        )
        self.publish_ready = Histogram(
            "loraplex_router_publish_ready_seconds",
            "An upload that waits for readiness, from its request to the new revision ready on "
            "every worker of its pools",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0),
            registry=self.registry,
        )
