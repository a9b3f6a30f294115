"""`loraplex placement`: the placement controller's process, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import httpx
from prometheus_client import start_http_server

from loraplex.placement.controller import PlacementController, Target
from loraplex.placement.policy import PlacementPolicy
from loraplex.registry import Registry
from loraplex.registry.rollouts import this_holder
from loraplex.settings.placement import PlacementSettings
from loraplex.settings.pools import DEFAULT_POOL, PoolSpec


def targets_of(settings: PlacementSettings) -> list[Target]:
    """`--worker`s in the default pool, then each `--pool`'s workers."""
    default = PoolSpec(DEFAULT_POOL)
    targets = [Target(url.rstrip("/"), default) for url in settings.worker]
    return targets + [Target(url, pool) for pool in settings.pool for url in pool.workers]


def policy_of(settings: PlacementSettings) -> PlacementPolicy:
    return PlacementPolicy(
        max_replicas=settings.max_replicas,
        per_replica_rps=settings.per_replica_rps,
        max_moves_per_hour=settings.max_moves_per_hour,
        min_rps=settings.min_rps,
        min_dwell_s=settings.min_dwell_s,
        min_hot_s=settings.min_hot_s,
        release_ratio=settings.release_ratio,
        placed_slot_share=settings.slot_share,
        min_free_slots=settings.min_free_slots,
    )


def run_placement(settings: PlacementSettings, token: str) -> int:
    """Serve the metrics (when asked), then rounds until a stop signal; 0 then."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per state poll otherwise
    registry = Registry(settings.registry, actor="placement", create=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=headers, timeout=settings.timeout_s) as client:
        controller = PlacementController(
            targets_of(settings),
            registry,
            policy_of(settings),
            client,
            settings.tier,
            this_holder(),
            settings.lease_s,
        )
        if settings.metrics_port is not None:
            server, _ = start_http_server(
                settings.metrics_port, settings.host, controller.metrics.registry
            )
            port = server.server_address[1]
            print(f"placement metrics on http://{settings.host}:{port}/metrics", flush=True)
        try:
            controller.run(stop, settings.interval_s)
        finally:
            registry.close()
    sys.stdout.flush()
    return 0
