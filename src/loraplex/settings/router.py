"""`loraplex router`'s settings, declared once (flags, `--config` keys, `LORAPLEX_ROUTER_*`
variables, docs); `PickerConfig` and `RouterConfig` take their defaults from `DEFAULTS`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.settings.fields import at_least, check_fields, open_share, positive, setting, weights
from loraplex.settings.pools import PoolSpec, parse_pools

WHERE, POOLS, ROUTING, TIMING = "Where", "Pools", "Routing", "Polling and timeouts"
FAIR = "Fair share"
ENV_PREFIX = "LORAPLEX_ROUTER_"
POLICIES = ("affinity", "round-robin", "least-loaded", "pure-affinity")

WEIGHTS = {
    "affinity": "w_affinity",
    "queue": "w_queue",
    "tokens": "w_tokens",
    "evictions": "w_evictions",
    "prefix": "w_prefix",
}
"""`--score-weights NAME=W,...`: the picker's score terms, by their short names."""


def _url(url: str) -> str | None:
    return None if url.startswith(("http://", "https://")) else "is not an http(s) URL"


@dataclass(frozen=True)
class RouterSettings:
    worker: tuple[str, ...] = setting(
        (),
        "A worker's base URL; repeat for each worker",
        panel=WHERE,
        metavar="URL",
        default_text="required without --pool",
        doc="the workers (`loraplex serve`) of the shared `default` pool (no base model or rank "
        "declared)",
    )
    pool: tuple[PoolSpec, ...] = setting(
        (),
        "A pool: name=N,base-model=B,max-rank=R,tenants=T1+T2,workers=URL1+URL2[,role=warm|canary];"
        " repeat per pool",
        panel=POOLS,
        metavar="SPEC",
        parse=parse_pools,
        show=lambda pools: [p.as_dict() for p in pools],
        doc='a pool of workers (below, "Pools"): `name`, `base-model` (the served name its '
        "workers report), optional `base-model-digest`, `max-rank`, `tenants` it is dedicated "
        "to (none: shared), `workers`, optional `role` (`warm`: pinned and tier-A adapters go "
        "there first; `canary`: a rollout's canary revision does); in a `--config` file a list of "
        "mappings",
    )
    policy: str = setting(
        "affinity",
        "How a worker is picked",
        panel=ROUTING,
        choices=POLICIES,
        doc='below, "Picking" (`pure-affinity`: residency first, load ignored)',
    )
    admin_token_file: Path | None = setting(
        None,
        "Admin token: reads workers' /admin/state, guards /admin",
        panel=WHERE,
        metavar="FILE",
    )
    registry: str | None = setting(
        None,
        "Registry URL: callers' tenants, adapters' base models, the revision of split names",
        panel=WHERE,
        metavar="URL",
        doc="the registry: callers' tenants and priorities, each adapter revision's base model and "
        'rank (below, "Pools"), and the split of names with a canary (below, "Split names")',
    )
    host: str = setting("127.0.0.1", "Address to listen on", panel=WHERE)
    port: int = setting(8080, "Port (0: a free one, printed at start)", panel=WHERE)
    metrics_token_file: Path | None = setting(
        None,
        "Token /metrics requires (no file: /metrics is open)",
        panel=WHERE,
        metavar="FILE",
    )
    saturation_waiting: int = setting(
        5,
        "A worker with more requests waiting than this is saturated (affinity gives way)",
        panel=ROUTING,
        check=at_least(0),
        doc="a worker with more requests waiting than this (its own count, or the router's "
        "requests open there beyond those running; beyond its places where it reports its "
        "`max_num_seqs`) is saturated: "
        "affinity gives way to spreading; higher keeps adapters' traffic together at the "
        "cost of waiting",
    )
    saturation_kv_usage: float = setting(
        0.8,
        "...or with more of its KV cache in use than this share",
        panel=ROUTING,
        check=open_share,
    )
    score_weights: tuple[tuple[str, float], ...] = setting(
        (),
        "The picker's score terms NAME=W,...",
        panel=ROUTING,
        metavar="NAME=W,...",
        parse=weights(WEIGHTS, minimum=0.0),
        show=dict,
        default_text="affinity=1, queue=0.5, tokens=0.2, evictions=0.2, prefix=0.5",
        doc="the picker's score terms (below); a larger `queue` spreads a hot adapter sooner, "
        "`prefix=0` ignores prompt prefixes",
    )
    prefix_index_blocks: int = setting(
        8192,
        "Prompt blocks remembered per worker for prefix-aware routing (0: none)",
        panel=ROUTING,
        check=at_least(0),
        doc="the prompt blocks (64 characters or 16 token ids each) the router remembers per "
        'worker, least recently routed out first (below, "Prefixes"); about 100 bytes each; '
        "near the worker's KV cache in blocks is best, 0 turns prefix-aware routing off",
    )
    load_factor: float = setting(
        1.25,
        "Bounded-load hashing: a cold adapter's worker carries up to this x mean load",
        panel=ROUTING,
        check=lambda v: None if v >= 1.0 else "must be at least 1 (the mean load)",
        doc="bounded-load hashing of cold adapters: a worker may carry this times the mean "
        "load before the next on the ring takes them; lower spreads evenly, higher keeps "
        "each cold adapter on fewer workers",
    )
    shed_priority_below: int = setting(
        0,
        "When every worker is saturated, tenants below this priority get 429",
        panel=ROUTING,
        doc="when every worker is saturated, tenants with a lower registry priority get 429 "
        "instead of a worker",
    )
    queue_per_tenant: int = setting(
        256,
        "Requests a tenant may have waiting at the router while its workers are saturated",
        panel=FAIR,
        check=at_least(0),
        doc="when every worker a request may use is saturated, it waits at the router in its "
        'tenant\'s queue (below, "Fair share"); a tenant with this many waiting gets 429 '
        "`saturated`; 0: no queue, the request goes to the least-bad saturated worker",
    )
    worker_queue_limit: int = setting(
        0,
        "Requests the router lets wait in a worker's own queue beyond what it runs (-1: any)",
        panel=FAIR,
        check=at_least(-1),
        doc="the router keeps at most a worker's running capacity (the `max_num_seqs` its state "
        "reports) plus this many requests open there: a worker at that count is saturated, and "
        'what no worker has room for waits at the router, in fair order (below, "Fair share"), '
        "rather than in a worker's first-come queue; -1: no limit (a worker that reports no "
        "capacity, as vLLM's own server, has none)",
    )
    tenant_weights: tuple[tuple[str, float], ...] = setting(
        (),
        "Tenants' weights in the fair share of saturated workers: TENANT=W,...",
        panel=FAIR,
        metavar="TENANT=W,...",
        parse=weights(None, label="TENANT", above=0.0),
        show=dict,
        default_text="each 1",
        doc="each tenant's weight in the fair share of saturated workers, within its priority "
        "band; a tenant not named weighs 1",
    )
    holdback_window_s: float = setting(
        5.0,
        "Keep places free for another tenant that sent a request within this many seconds (0: off)",
        panel=FAIR,
        metavar="S",
        check=at_least(0),
        doc="while a tenant over its fair share of the places of the workers a request may use "
        "fills them, the router keeps places free for each other tenant of its band (or a "
        "higher one) that sent a request that could go there within this many seconds and holds "
        "less than its share there (as many as it had open at once within the last minute, at "
        "least one), so that tenant's next requests start at once (below, \"Fair "
        'share"); counted per pool, never fleet-wide; a tenant alone is never held back; 0: '
        "nothing held",
    )
    poll_interval_s: float = setting(
        0.5,
        "Seconds between polls of each worker's state",
        panel=TIMING,
        check=positive,
        doc="each worker's state is read this often: fresher affinity against polling load",
    )
    stale_after_s: float = setting(
        2.0,
        "A worker's state older than this is not used for affinity",
        panel=TIMING,
        check=positive,
        doc="state older than this counts as unknown load and residency",
    )
    poll_timeout_s: float = setting(
        2.0,
        "A poll slower than this marks the worker out",
        panel=TIMING,
        check=positive,
        doc="a poll slower than this marks the worker out until a poll answers",
    )
    request_timeout_s: float = setting(
        300.0,
        "Longest wait for a worker's answer (504 beyond)",
        panel=TIMING,
        check=positive,
        doc="longest wait for a worker's answer (504 `gateway_timeout` beyond)",
    )

    def __post_init__(self):
        check_fields(self, RouterSettings)
        if not self.worker and not any(p.workers for p in self.pool):
            raise ValueError("--worker or --pool is required (the workers to route to)")
        for url in self.worker:
            if _url(url):
                raise ValueError(f"--worker {url!r} is not an http(s) URL")
        pooled = {u for p in self.pool for u in p.workers}
        both = [u for u in self.worker if u.rstrip("/") in pooled]
        if both:
            raise ValueError(f"--worker {both[0]} is in a --pool too: give it once")
        dedicated = [p.name for p in self.pool if p.tenants]
        if dedicated and not self.registry:
            raise ValueError(
                f"pool {dedicated[0]} is dedicated to tenants: the router needs --registry to "
                "know a caller's tenant"
            )


DEFAULTS = RouterSettings(worker=("http://defaults",))
"""Each setting's default, read by the router's configurations."""
