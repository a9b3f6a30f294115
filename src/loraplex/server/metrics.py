"""Prometheus series: every `loraplex_` series of the architecture doc, and the Gateway API
Inference Extension's `vllm:` model-server series. Labels per tenant, never per adapter (top-K
adapters only, opt-in).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from loraplex.engines.rank_skew import RANK_BUCKETS, rank_bucket
from loraplex.residency.events import (
    BudgetWait,
    Event,
    Eviction,
    LoadFailed,
    LoadStage,
    Lookup,
    ReloadAfterEviction,
)

LOAD_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIERS = ("gpu", "cpu", "disk", "remote")
RankOf = Callable[[str, str], "int | None"]  # (name, revision) -> rank
# The cache's load stages, and the histogram each one feeds.
STAGE_SERIES = {
    "resolve": "resolve",
    "download": "remote_download",
    "disk": "disk_load",
    "h2d": "h2d",
    "activation": "activation",
}


class ServerMetrics:
    """Counters and histograms fed by the server and the cache's events; gauges read live at scrape
    time.

    `snapshot()` returns the live figures: {"cache": Residency.state(), "num_waiting",
    "num_running", "kv_cache_usage", "running_adapters", "waiting_adapters", "max_loras"}. With
    `load_state_top_k`, the residency series of the load-state proposal cover the K best-placed
    adapters; `rank_of(name, revision)` gives their rank label.
    """

    def __init__(
        self,
        snapshot: Callable[[], dict],
        top_k_adapters: int = 0,
        load_state_top_k: int = 0,
        rank_of: RankOf | None = None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self._adapter_series(r)
        self._request_series(r)
        self.loop_lag = Histogram(
            "loraplex_event_loop_lag_seconds",
            "How late the API server's event loop ran a timer due every 5 ms (a stall of every "
            "stream on the worker)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        for tier in TIERS[:3]:
            self.cache_hits.labels(tier)
        for tier in TIERS[:2]:
            self.evictions.labels(tier)
        for bucket in RANK_BUCKETS:
            self.rank_tokens.labels(bucket)
        self.top_k_adapters = top_k_adapters
        self.load_state_top_k = load_state_top_k
        self.rank_of = rank_of or (lambda name, revision: None)
        # (name, revision, digest) -> rank: fixed once known
        self._ranks: dict[tuple[str, str, str], int | None] = {}
        self.adapter_requests: Tally[str] = Tally()
        self.adapter_tokens: Tally[str] = Tally()
        self._children: dict[tuple, object] = {}
        r.register(_LiveCollector(snapshot, self))

    def _adapter_series(self, r: CollectorRegistry) -> None:
        """The adapter life cycle's series: tier hits, misses, evictions, reloads, failures, load
        stages."""
        self.cache_hits = Counter(
            "loraplex_adapter_cache_hits_total",
            "Requests whose adapter was found in a tier (L0 gpu, L1 cpu, L2 disk)",
            ["tier"],
            registry=r,
        )
        self.cache_misses = Counter(
            "loraplex_adapter_cache_misses_total",
            "Requests whose adapter had to come from the remote store (L3)",
            registry=r,
        )
        self.evictions = Counter(
            "loraplex_adapter_evictions_total", "Adapters evicted from a tier", ["tier"], registry=r
        )
        self.reloads = Counter(
            "loraplex_adapter_reload_after_eviction_total",
            "Adapters loaded again within the thrash window after their eviction",
            registry=r,
        )
        self.load_failures = Counter(
            "loraplex_adapter_load_failures_total",
            "Adapter loads that failed",
            ["error"],
            registry=r,
        )
        self._publish_series(r)
        self.stages = {
            stage: Histogram(
                f"loraplex_adapter_{series}_seconds",
                f"Adapter load stage: {stage}",
                buckets=LOAD_BUCKETS,
                registry=r,
            )
            for stage, series in STAGE_SERIES.items()
        }

    def _publish_series(self, r: CollectorRegistry) -> None:
        """Publishing's series: uploads, their readiness, the revisions retired and unloaded."""
        self.published_bytes = Counter(
            "loraplex_adapter_published_bytes_total",
            "Bytes of adapters uploaded to this worker's admin API (its upload endpoint)",
            registry=r,
        )
        self.publish_seconds = Histogram(
            "loraplex_adapter_publish_seconds",
            "An upload to this worker's admin API, from its request to its revision registered "
            "(receive, unpack, digest, checks, store, record)",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.publish_ready_seconds = Histogram(
            "loraplex_adapter_publish_ready_seconds",
            "An upload that waits for readiness, from its request to the new revision ready on "
            "every worker it waits for",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.revisions_retired = Counter(
            "loraplex_adapter_revisions_retired_total",
            "Revisions this worker saw the registry retire (gone from its catalog)",
            registry=r,
        )
        self.retired_unloads = Counter(
            "loraplex_adapter_retired_unloads_total",
            "Revisions this worker unloaded because the registry retired them",
            registry=r,
        )

    def _request_series(self, r: CollectorRegistry) -> None:
        """The requests' series: latencies, counts by tenant and status, cold starts, tokens."""
        self.ttft = Histogram(
            "loraplex_request_ttft_seconds",
            "Time to first token, by the tier the adapter was in on arrival",
            ["tier"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "loraplex_request_tpot_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "loraplex_request_queue_wait_seconds",
            "Time from arrival to admission into the running batch",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "loraplex_requests_total",
            "Inference requests by tenant and HTTP status",
            ["tenant", "code"],
            registry=r,
        )
        self.cold_starts = Counter(
            "loraplex_cold_starts_total",
            "Requests whose adapter was not in memory (disk or remote) on arrival",
            registry=r,
        )
        self.tenant_denied = Counter(
            "loraplex_tenant_denied_total",
            "Requests refused by tenancy: another "
            "tenant's adapter, or the tenant's concurrency quota",
            ["tenant"],
            registry=r,
        )
        self.budget_waits = Counter(
            "loraplex_tenant_budget_waits_total",
            "Requests that waited because their tenant was at its residency budget (once per wait)",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "loraplex_tenant_generated_tokens_total",
            "Output tokens generated for a tenant's requests (the responses' completion_tokens)",
            ["tenant"],
            registry=r,
        )
        self.rank_tokens = Counter(
            "loraplex_rank_generated_tokens_total",
            "Output tokens generated, by the rank bucket of the request's adapter (base: none)",
            ["rank_bucket"],
            registry=r,
        )

    def on_cache_event(self, event: Event) -> None:
        """The residency's `on_event` hook (called from its threads; prometheus_client is
        thread-safe)."""
        match event:
            # the architecture's levels: a disk hit (L2) is a hit, only the remote store is a miss
            case Lookup(tier="remote"):
                self.cache_misses.inc()
            case Lookup(tier):
                self._child(self.cache_hits, tier).inc()
            case Eviction(tier):
                self.evictions.labels(tier).inc()
            case ReloadAfterEviction():
                self.reloads.inc()
            case LoadStage(stage, seconds) if stage in self.stages:
                self.stages[stage].observe(seconds)
            case BudgetWait(tenant):
                self.budget_waits.labels(tenant).inc()
            case LoadFailed(error=error):
                self.load_failures.labels(error).inc()

    def _child(self, metric, *labels: str):
        """`metric.labels(*labels)`, looked up once per label values (a child lives as long as its
        metric; labels() validates and locks at every call)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def on_request(
        self,
        tenant: str,
        status: int,
        adapter: str | None,
        tier: str | None,
        denied: bool,
        completion_tokens: int = 0,
        rank: int | None = None,
    ) -> None:
        """One finished inference request; `completion_tokens` as its usage counts them, `rank`
        its adapter's."""
        self._child(self.requests, tenant, str(status)).inc()
        if denied:
            self.tenant_denied.labels(tenant).inc()
        if tier in ("disk", "remote") and status < 400:
            self.cold_starts.inc()
        if completion_tokens:
            self._child(self.tenant_tokens, tenant).inc(completion_tokens)
            self._child(self.rank_tokens, rank_bucket(rank)).inc(completion_tokens)
        if adapter and self.top_k_adapters:
            self.adapter_requests[adapter] += 1
            self.adapter_tokens[adapter] += completion_tokens

    def on_timings(
        self, tier: str, ttft_s: float | None, tpot_s: float | None, queue_wait_s: float | None
    ) -> None:
        if ttft_s is not None:
            self._child(self.ttft, tier).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def rank(self, adapter: dict) -> int | None:
        """The rank of a cache state entry, looked up once per revision (its bytes never change)."""
        key = (adapter["name"], adapter["revision"], adapter["digest"])
        if key not in self._ranks:
            self._ranks[key] = self.rank_of(adapter["name"], adapter["revision"])
        return self._ranks[key]


def load_state_series(live: dict, top_k: int, rank: Callable[[dict], int | None]):
    """The per-adapter residency series of the load-state proposal (llm-d-router PR 2792): the K
    adapters in a device slot or host memory that matter most (slots first, then pinned, then the
    busiest), so the number of series stays bounded whatever the catalog's size."""
    resident = [a for a in live["cache"]["adapters"] if a["tier"] in ("gpu", "cpu")]
    resident.sort(
        key=lambda a: (
            a["tier"] != "gpu",
            a["pinned"] is None,
            -a["demand_5m"],
            a["last_access_s_ago"],
            a["name"],
            a["revision"],
        )
    )
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded",
        "1 per resident adapter (top K): its level is gpu (a device slot) or cpu (host memory)",
        labels=["adapter_name", "level", "pinned", "rank"],
    )
    for a in resident[:top_k]:
        r = rank(a)
        loaded.add_metric(
            [
                a["model"],
                a["tier"],
                "true" if a["pinned"] else "false",
                "" if r is None else str(r),
            ],
            1,
        )
    yield loaded
    on_gpu = sum(1 for a in resident if a["tier"] == "gpu")
    yield GaugeMetricFamily(
        "vllm:num_gpu_loaded_lora_adapters", "Adapters in a device slot", value=on_gpu
    )
    yield GaugeMetricFamily(
        "vllm:max_gpu_lora_adapters", "Device slots for adapters", value=live["max_loras"]
    )


def _tenant_gauges(tenants: dict):
    """Per tenant and tier (gpu, cpu), the adapters charged to it there and their bytes; per
    tenant with a limit, its budgets."""
    count = GaugeMetricFamily(
        "loraplex_tenant_resident_count",
        "Adapters charged to a tenant per tier (those its requests hold, or used last)",
        labels=["tenant", "tier"],
    )
    size = GaugeMetricFamily(
        "loraplex_tenant_resident_bytes",
        "Bytes of the adapters charged to a tenant per tier",
        labels=["tenant", "tier"],
    )
    max_slots = GaugeMetricFamily(
        "loraplex_tenant_budget_slots",
        "A tenant's residency budget in device slots (tenants with a limit only)",
        labels=["tenant"],
    )
    max_bytes = GaugeMetricFamily(
        "loraplex_tenant_budget_bytes",
        "A tenant's residency budget in host bytes (tenants with a limit only)",
        labels=["tenant"],
    )
    for tenant, row in tenants.items():
        count.add_metric([tenant, "gpu"], row["gpu"]["slots"])
        count.add_metric([tenant, "cpu"], row["cpu"]["count"])
        size.add_metric([tenant, "gpu"], row["gpu"]["bytes"])
        size.add_metric([tenant, "cpu"], row["cpu"]["bytes"])
        if row["gpu"]["max_slots"] is not None:
            max_slots.add_metric([tenant], row["gpu"]["max_slots"])
        if row["cpu"]["max_bytes"] is not None:
            max_bytes.add_metric([tenant], row["cpu"]["max_bytes"])
    yield count
    yield size
    yield max_slots
    yield max_bytes


RANK_SKEW_SERIES = {
    "step_seconds": (
        "loraplex_engine_step_seconds",
        "Engine step time, by the rank bucket of the largest adapter in the step's batch",
    ),
    "tpot_seconds": (
        "loraplex_request_tpot_by_rank_seconds",
        "Time per output token after the first, by the rank bucket of the request's adapter",
    ),
}


def _rank_skew_histograms(rank_skew: dict):
    """The engine's rank-skew figures (`loraplex.engines.rank_skew.RankSkew.snapshot`) as
    histograms with a `rank_bucket` label."""
    for key, (name, documentation) in RANK_SKEW_SERIES.items():
        figures = rank_skew[key]
        bounds = [*(str(b) for b in figures["bounds"]), "+Inf"]
        family = HistogramMetricFamily(name, documentation, labels=["rank_bucket"])
        for bucket, row in figures["buckets"].items():
            cumulative, running = [], 0
            for bound, count in zip(bounds, row["counts"]):
                running += count
                cumulative.append((bound, running))
            family.add_metric([bucket], cumulative, row["sum"])
        yield family


class _LiveCollector:
    """Gauges read at scrape time from the cache and the scheduler."""

    def __init__(self, snapshot: Callable[[], dict], metrics: ServerMetrics):
        self.snapshot = snapshot
        self.metrics = metrics

    def describe(self):
        return []  # names are only known by collect(); keeps registration free of a snapshot call

    def collect(self):
        live = self.snapshot()
        cache = live["cache"]
        count = GaugeMetricFamily(
            "loraplex_adapter_resident_count", "Adapters resident per tier", labels=["tier"]
        )
        size = GaugeMetricFamily(
            "loraplex_adapter_resident_bytes",
            "Bytes of adapters resident per tier",
            labels=["tier"],
        )
        for tier in TIERS[:3]:
            count.add_metric([tier], cache["resident"][tier]["count"])
            size.add_metric([tier], cache["resident"][tier]["bytes"])
        yield count
        yield size
        yield from _tenant_gauges(cache.get("tenants", {}))
        if "engine_alive" in live:
            yield GaugeMetricFamily(
                "loraplex_engine_alive",
                "1 while the engine runs (/health green), 0 once it has stopped",
                value=1 if live["engine_alive"] else 0,
            )
        if "rank_skew" in live:
            yield from _rank_skew_histograms(live["rank_skew"])
        if "empty_steps" in live:
            yield CounterMetricFamily(
                "loraplex_engine_empty_steps",
                "Engine steps that found nothing to run (requests waiting that none may join yet)",
                value=live["empty_steps"],
            )
        yield GaugeMetricFamily(
            "loraplex_adapter_thrash_ratio",
            "Reloads after eviction per eviction",
            value=cache.get("thrash_ratio", 0.0),
        )
        yield from _vllm_series(live)
        if self.metrics.load_state_top_k:
            yield from load_state_series(live, self.metrics.load_state_top_k, self.metrics.rank)
        if self.metrics.top_k_adapters:
            yield from _top_adapters(self.metrics)


def _vllm_series(live: dict):
    """The series under vLLM's own names, which gateways (llm-d's EPP) read."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running (gpu-resident) and waiting adapters; the value is the update time",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric(
        [
            ",".join(live["running_adapters"]),
            ",".join(live["waiting_adapters"]),
            str(live["max_loras"]),
        ],
        time.time(),
    )
    yield info
    yield GaugeMetricFamily(
        "vllm:num_requests_waiting", "Requests waiting", value=live["num_waiting"]
    )
    yield GaugeMetricFamily(
        "vllm:num_requests_running", "Requests running", value=live["num_running"]
    )
    yield GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV cache usage (0-1)", value=live["kv_cache_usage"]
    )
    prefix = live.get("prefix_cache", {"queries": 0, "hits": 0})
    yield CounterMetricFamily(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in tokens looked up",
        value=prefix["queries"],
    )
    yield CounterMetricFamily(
        "vllm:prefix_cache_hits", "Prefix cache hits, in tokens found", value=prefix["hits"]
    )


def _top_adapters(metrics: ServerMetrics):
    """Requests and tokens of the top-K adapters by requests."""
    top = CounterMetricFamily(
        "loraplex_adapter_requests", "Requests of the top-K adapters", labels=["adapter"]
    )
    tokens = CounterMetricFamily(
        "loraplex_adapter_generated_tokens",
        "Output tokens generated for the top-K adapters by requests",
        labels=["adapter"],
    )
    for adapter, n in metrics.adapter_requests.most_common(metrics.top_k_adapters):
        top.add_metric([adapter], n)
        tokens.add_metric([adapter], metrics.adapter_tokens[adapter])
    yield top
    yield tokens
