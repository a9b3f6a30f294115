"""Running the router under uvicorn (the CLI's `loraplex router`)."""

from __future__ import annotations

import socket
import sys

import uvicorn

from loraplex.router.app import RouterConfig, create_router_app, registry_priorities
from loraplex.router.picker import POLICIES


def serve_router(
    workers: list[str],
    policy: str,
    admin_token: str | None,
    registry: str | None,
    host: str,
    port: int,
    metrics_token: str | None = None,
    **tuning,
) -> int:
    """`tuning`: RouterConfig's timing fields (stale_s, poll_s, poll_timeout_s,
    request_timeout_s) and `picker`, a PickerConfig."""
    if policy not in POLICIES:
        print(f"error: --policy {policy!r}: use one of {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    bad = [w for w in workers if not w.startswith(("http://", "https://"))]
    if bad:
        print(f"error: --worker {bad[0]!r} is not an http(s) URL", file=sys.stderr)
        return 2
    if registry:
        tuning["priority_of"] = registry_priorities(registry)
    config = RouterConfig(
        tuple(workers), policy, admin_token, metrics_token=metrics_token, **tuning
    )
    app = create_router_app(config)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    print(
        f"loraplex router listening on http://{host}:{sock.getsockname()[1]} "
        f"({len(workers)} workers, policy {policy})",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0
