"""Running the router under uvicorn (the CLI's `loraplex router`)."""

from __future__ import annotations

import socket

import uvicorn

from loraplex.registry.registry import open_existing
from loraplex.router.app import RouterConfig, create_router_app, registry_callers
from loraplex.router.catalog import registry_catalog
from loraplex.router.picker import PickerConfig
from loraplex.router.splits import registry_splits
from loraplex.settings.router import RouterSettings


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
        **(_from_registry(s.registry) if s.registry else {}),
    )
    app = create_router_app(config)
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
