"""Running the router under uvicorn (the CLI's `loraplex router`)."""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable

import uvicorn

from loraplex.host_memory import freeze_startup
from loraplex.registry.registry import Registry, open_existing
from loraplex.router.app import OPEN_TENANT, RouterConfig, create_router_app, open_caller
from loraplex.router.catalog import registry_catalog
from loraplex.router.picker import PickerConfig
from loraplex.router.splits import registry_splits
from loraplex.settings.router import RouterSettings

log = logging.getLogger("loraplex.router")


def serve_router(
    s: RouterSettings, admin_token: str | None, metrics_token: str | None = None
) -> int:
    config = RouterConfig(
        s.worker,
        s.policy,
        admin_token,
        metrics_token=metrics_token,
        stale_after_s=s.stale_after_s,
        poll_interval_s=s.poll_interval_s,
        poll_timeout_s=s.poll_timeout_s,
        request_timeout_s=s.request_timeout_s,
        picker=PickerConfig.from_settings(s),
        pools=s.pool,
        prefix_blocks=s.prefix_index_blocks,
        queue_per_tenant=s.queue_per_tenant,
        tenant_weights=s.tenant_weights,
        holdback_window_s=s.holdback_window_s,
        **(_from_registry(s.registry) if s.registry else {}),
    )
    app = create_router_app(config)
    freeze_startup()
    workers = list(app.state.fleet.workers.values())
    sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((s.host, s.port))
    print(
        f"loraplex router listening on http://{s.host}:{sock.getsockname()[1]} "
        f"({len(workers)} workers in {len({w.pool.name for w in workers})} pools, "
        f"policy {s.policy})",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


def _from_registry(url: str) -> dict:
    """What the router reads from the registry: callers' tenants, split names, adapters' bases.
    It only reads: a registry that is not there is a RegistryError, and nothing is created."""
    registry = open_existing(url)
    return {
        "caller_of": registry_callers(registry),
        "splits": registry_splits(registry),
        "catalog": registry_catalog(registry),
    }


def registry_callers(
    registry: Registry, clock: Callable[[], float] = time.monotonic
) -> Callable[[str], tuple[str | None, int]]:
    """Bearer key -> (tenant, its priority), read from `registry` (remembered per key for a
    minute; while the registry cannot be read, the last answer stands); no key: the open
    tenant."""
    memo: dict[str, tuple[float, tuple[str | None, int]]] = {}

    tenants: list = [-math.inf, {}]  # when read, tenant -> priority

    def caller_of(key: str) -> tuple[str | None, int]:
        now = clock()
        if key in memo and now - memo[key][0] < 60:
            return memo[key][1]
        try:
            if now - tenants[0] >= 60:
                tenants[:] = [now, {t.name: t.priority for t in registry.list_tenants()}]
            tenant = registry.tenant_for_key(key) if key else OPEN_TENANT
            caller = (tenant, tenants[1].get(tenant, 0))
        except Exception as exc:  # noqa: BLE001 (a registry problem must not fail the routing)
            log.warning("tenant lookup failed, the last answer stands: %s", exc)
            # not remembered: asked again at the next request
            return memo[key][1] if key in memo else open_caller(key)
        if len(memo) >= 10_000:  # any client can send keys: keep the memo bounded
            memo.clear()
        memo[key] = (now, caller)
        return caller

    return caller_of
