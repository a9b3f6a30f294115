"""The FastAPI application: `create_app(engine, registry, config)` wires the OpenAI API, the admin
API, health, readiness and metrics around one `Server`. The app owns the engine from then on (it
stops it)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.registry import Registry
from loraplex.server import admin, openai_api, placement_admin, rl_api, rollout_admin
from loraplex.server.auth import check_token
from loraplex.server.errors import APIError, install_handlers
from loraplex.server.middleware import RequestMiddleware
from loraplex.server.server import Server, ServerConfig

if TYPE_CHECKING:
    from loraplex.engines.contract import Engine

__all__ = ["Server", "ServerConfig", "create_admin_app", "create_app"]


def create_app(
    engine: Engine,
    registry: Registry,
    config: ServerConfig,
    api_keys: dict[str, str] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app (and the admin API on it unless `config.admin_on_main_app` is
    False)."""
    server = Server(engine, registry, config, api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()  # the engine's too, on this loop
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="loraplex", lifespan=lifespan, redoc_url=None)  # /docs and /openapi.json
    app.state.server = server
    # how the OpenAI requests run: the server's own layer over the engine's generation, or the
    # engine's own serving layer (the engine picks)
    app.state.requests = engine.request_layer(openai_api.RequestLayers(server))
    install_handlers(app)
    app.add_middleware(
        RequestMiddleware, on_done=server.finish_request, direct=openai_api.DIRECT_ENDPOINTS
    )
    app.include_router(openai_api.router)
    app.include_router(health)
    if config.admin_token and config.admin_on_main_app:
        app.include_router(admin.router(config.admin_token))
        app.include_router(placement_admin.router(config.admin_token))
        app.include_router(rollout_admin.router(config.admin_token))
        app.include_router(rl_api.router(config.admin_token))
    return app


def create_admin_app(server: Server) -> FastAPI:
    """The admin API alone, for its own port, over the main app's server (`app.state.server`, whose
    app runs the engine)."""
    if not server.config.admin_token:
        raise ValueError("the admin API needs an admin token")
    app = FastAPI(title="loraplex admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_handlers(app)
    app.add_middleware(RequestMiddleware, on_done=server.finish_request)
    app.include_router(admin.router(server.config.admin_token))
    app.include_router(placement_admin.router(server.config.admin_token))
    app.include_router(rollout_admin.router(server.config.admin_token))
    app.include_router(rl_api.router(server.config.admin_token))
    return app


health = APIRouter()


@health.get("/health")
async def alive(request: Request):
    server: Server = request.app.state.server
    if not server.engine_alive():
        raise APIError(503, "unhealthy: the engine has stopped", "engine_unavailable")
    return {"status": "ok"}


@health.get("/ready")
async def ready(request: Request):
    server: Server = request.app.state.server
    if not server.is_started or server.is_draining:
        raise APIError(
            503,
            "not ready: " + ("shutting down" if server.is_draining else "starting"),
            "not_ready",
        )
    return {"status": "ready", "model": server.config.served_model_name}


@health.get("/metrics")
async def metrics(request: Request):
    server: Server = request.app.state.server
    if server.config.metrics_token:
        check_token(request.headers.get("authorization"), server.config.metrics_token, "metrics")
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)
