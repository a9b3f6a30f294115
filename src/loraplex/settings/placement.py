"""`loraplex placement`'s settings, declared once (flags, `--config` keys,
`LORAPLEX_PLACEMENT_*` variables, docs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.settings.fields import at_least, positive, setting
from loraplex.settings.pools import PoolSpec, parse_pools

WHERE, POLICY, TIMING = "Where", "Policy", "Timing"
ENV_PREFIX = "LORAPLEX_PLACEMENT_"
TIERS = ("gpu", "cpu")


@dataclass(frozen=True)
class PlacementSettings:
    registry: str = setting(
        "",
        "Registry URL: the adapters, and the controller's lease",
        panel=WHERE,
        metavar="URL",
        default_text="required",
        doc="the registry the workers share: the adapters placed (their base, rank, bytes, "
        "tenant) and the lease that keeps one controller active",
    )
    worker: tuple[str, ...] = setting(
        (),
        "A worker's base URL (the default pool); repeat for each",
        panel=WHERE,
        metavar="URL",
        default_text="required without --pool",
        doc="the workers (`loraplex serve`) of the shared `default` pool",
    )
    pool: tuple[PoolSpec, ...] = setting(
        (),
        "A pool as the router takes it: name=N,...,workers=URL1+URL2; repeat per pool",
        panel=WHERE,
        metavar="SPEC",
        parse=parse_pools,
        show=lambda pools: [p.as_dict() for p in pools],
        doc="a pool of workers, in `loraplex router --pool`'s form; its `tenants` keep a "
        "tenant's adapters on its dedicated pools",
    )
    admin_token_file: Path | None = setting(
        None, "The workers' admin token", panel=WHERE, metavar="FILE", default_text="required"
    )
    metrics_port: int | None = setting(
        None,
        "Serve the controller's metrics on this port (0: any free one)",
        panel=WHERE,
        metavar="PORT",
        check=at_least(0),
        default_text="none",
        doc="serve `/metrics` (`loraplex_placement_*`) on this port; 0 picks a free one, and "
        "the address is printed",
    )
    host: str = setting("127.0.0.1", "Address the metrics are served on", panel=WHERE)
    tier: str = setting(
        "gpu",
        "Where a placed adapter is kept warm",
        panel=POLICY,
        choices=TIERS,
        doc="`gpu`: a device slot (up to `--slot-share` of a worker's slots); `cpu`: host memory",
    )
    max_replicas: int = setting(
        4, "The most workers one adapter is placed on", panel=POLICY, check=at_least(1)
    )
    per_replica_rps: float = setting(
        8.0,
        "Requests per second one warm worker serves for one adapter",
        panel=POLICY,
        check=positive,
        doc="an adapter is placed on one worker per this many requests per second of its "
        "demand (the workers' demand windows, summed), up to `--max-replicas`",
    )
    min_rps: float = setting(
        0.05,
        "Demand (requests per second) that makes an adapter hot enough to place",
        panel=POLICY,
        check=positive,
    )
    max_moves_per_hour: int = setting(
        600,
        "Moves (places and releases) per hour, at most",
        panel=POLICY,
        check=at_least(0),
        doc="moves per hour, at most (a burst of a tenth of it), so that placement does not thrash",
    )
    min_dwell_s: float = setting(
        300.0,
        "Seconds a placement stands before load or demand moves it",
        panel=POLICY,
        check=at_least(0),
        doc="seconds a placement stands before the policy moves it for load or demand (a "
        "drain or a dead worker moves it at once)",
    )
    min_hot_s: float = setting(
        30.0,
        "Seconds an adapter placed nowhere stays hot before it is placed",
        panel=POLICY,
        check=at_least(0),
        doc="seconds an adapter placed nowhere must stay at `--min-rps` or more before it is "
        "placed: a window's few requests swing an adapter near the threshold across it and "
        "back, and each crossing would be a place and, later, a release",
    )
    release_ratio: float = setting(
        0.5,
        "A placed adapter is released under this share of --min-rps",
        panel=POLICY,
        check=at_least(0),
        doc="a placed adapter is released once its demand falls under this share of "
        "`--min-rps` (at most 1): the band between keeps a placement through its demand's swings",
    )
    slot_share: float = setting(
        0.75,
        "The share of a worker's slots placement may fill",
        panel=POLICY,
        check=positive,
        doc="the share of a worker's device slots placement may fill, never more than leaves "
        "`--min-free-slots` (yet one on a worker of two or more slots); the rest is left to "
        "the worker's own residency",
    )
    min_free_slots: int = setting(
        2,
        "The device slots of each worker placement leaves unpinned, whatever the share",
        panel=POLICY,
        check=at_least(1),
        doc="the device slots of each worker placement leaves unpinned, whatever "
        "`--slot-share`: the adapters placed nowhere share them, and a worker's residency "
        "keeps a newly loaded adapter a second against less demanded ones, so with one such "
        "slot their requests wait in turn; a worker of two or more slots still takes one "
        "placement (vLLM at `--max-loras 2`), one of a single slot none "
        "(`loraplex_placement_workers_unplaceable`)",
    )
    interval_s: float = setting(
        10.0, "Seconds between rounds (poll, plan, act)", panel=TIMING, check=positive
    )
    lease_s: float = setting(
        30.0,
        "The controller's lease: another takes over this long after it stops renewing",
        panel=TIMING,
        check=positive,
        doc="how long the lease lasts without renewal (renewed each round and before each "
        "move); a second controller waits, and takes over once it runs out, or at once on the "
        "same host when the first's process is gone",
    )
    timeout_s: float = setting(
        60.0,
        "Seconds a call to a worker may take",
        panel=TIMING,
        check=positive,
        doc="seconds a call to a worker may take (a place waits for the adapter's load)",
    )

    def __post_init__(self):
        if not self.registry:
            raise ValueError("--registry is required (the adapters, and the controller's lease)")
        if not self.worker and not any(p.workers for p in self.pool):
            raise ValueError("--worker or --pool is required (the workers to place on)")
        if self.slot_share > 1:
            raise ValueError("--slot-share must be at most 1")
        if self.release_ratio > 1:
            raise ValueError("--release-ratio must be at most 1")
