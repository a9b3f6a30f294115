"""The gateway in front of several workers: pick a worker per request, proxy it (streaming too), retry once."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import secrets
from dataclasses import dataclass, field
from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from loraplex.router.fleet import Fleet
from loraplex.router.picker import Picker, PickerConfig

log = logging.getLogger("loraplex.router")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


TENANCY_REFUSALS = (401, 403, 404)


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    policy: str = "affinity"
    admin_token: str | None = None
    stale_s: float = 2.0
    poll_s: float = 0.5
    request_timeout_s: float = 300.0
    poll_timeout_s: float = 2.0
    """How long a worker's /admin/state poll may take before the worker is marked out."""
    priority_of: Callable[[str], int] = lambda key: 0
    """Bearer key -> its tenant's priority (from the registry's tenant records, when the router has one)."""
    picker: PickerConfig = field(default_factory=PickerConfig)
    seed: int | None = None
    metrics_token: str | None = None
    """When set, /metrics answers only `Authorization: Bearer <token>`."""


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.picks = Counter("loraplex_router_picks_total", "Routing decisions by reason", ["reason"],
                             registry=self.registry)
        self.retries = Counter("loraplex_router_retries_total", "Requests retried on another worker",
                               registry=self.registry)
        self.healthy = Gauge("loraplex_router_worker_healthy", "1 while the worker passes its health checks",
                             ["worker"], registry=self.registry)
        self.in_flight = Gauge("loraplex_router_worker_in_flight", "Requests proxied to the worker and not done",
                               ["worker"], registry=self.registry)


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": type_, "code": code, "param": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _valid_url(url: str) -> bool:
    try:
        return bool(httpx.URL(url).host)
    except (httpx.InvalidURL, ValueError):
        return False


async def _json_object(request: Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:  # not JSON, or not UTF-8
        return None
    return body if isinstance(body, dict) else None


def create_router_app(config: RouterConfig) -> FastAPI:
    fleet = Fleet(list(config.workers), config.admin_token, config.stale_s, config.poll_s,
                  config.poll_timeout_s)
    picker = Picker(config.policy, config.picker, random.Random(config.seed))
    metrics = RouterMetrics()
    # No cap on connections: httpx's default of 100 made the 101st concurrent request wait for one, and its
    # PoolTimeout looked like a failed worker.
    proxy = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=2.0),
                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    in_flight: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await fleet.poll_once()
        fleet.start()
        try:
            yield
        finally:
            await fleet.stop()
            await proxy.aclose()

    app = FastAPI(title="loraplex router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fleet, app.state.picker = fleet, picker

    def admin_ok(request: Request) -> bool:
        return bool(config.admin_token) and token_ok(request, config.admin_token)

    def token_ok(request: Request, token: str) -> bool:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        # bytes: compare_digest refuses str with non-ASCII characters (a 500 for a header anyone can send)
        return secrets.compare_digest(given.encode(), token.encode())

    async def forward(request: Request, path: str):
        body = await request.body()
        try:
            payload = json.loads(body or b"{}")
        except ValueError:  # not JSON, or not UTF-8
            return _error(400, "request body is not valid JSON", "invalid_json")
        model = payload.get("model") if isinstance(payload, dict) else None
        adapter = model if isinstance(model, str) else None
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        pick = picker.pick(fleet.views(), adapter, config.priority_of(key))
        if pick.url is None:
            metrics.picks.labels(pick.reason).inc()
            status, code = (429, "saturated") if pick.reason == "saturated-shed" else (503, "no_worker")
            return _error(status, f"no worker can take the request now ({pick.reason})", code,
                          "server_error", {"Retry-After": "1"})
        log.info("route model=%s worker=%s reason=%s", adapter, pick.url, pick.reason)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        for attempt, url in enumerate(pick.ranking[:2]):
            worker = fleet.workers.get(url)
            if worker is not None:
                worker.in_flight += 1
                if adapter is not None:
                    worker.sent.add(adapter)
            in_flight[url] = in_flight.get(url, 0) + 1
            metrics.in_flight.labels(url).set(in_flight[url])
            try:
                upstream = proxy.build_request("POST", f"{url}{path}", content=body, headers=headers)
                response = await proxy.send(upstream, stream=True)
            except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
                # The worker has the request and is slow (a non-streamed answer comes whole): neither a failed
                # worker nor one to run the generation again on.
                metrics.picks.labels(pick.reason).inc()
                done(url)
                return _error(504, f"worker {url} did not answer in time: {type(exc).__name__}", "gateway_timeout",
                              "server_error")
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                done(url)
                log.warning("worker %s failed before the first byte: %s", url, exc)
                if worker is not None:
                    worker.healthy = False
                if attempt == 0 and len(pick.ranking) > 1:
                    metrics.retries.inc()
                    continue
                metrics.picks.labels(pick.reason).inc()
                return _error(502, f"worker failed: {type(exc).__name__}", "bad_gateway", "server_error")
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            # The pick was made from the model name alone, before any worker checked the caller's key: where the
            # worker refuses the caller (401, 403, or 404 for another tenant's adapter), neither the answer nor the
            # pick counts may tell where that adapter is resident.
            if response.status_code not in TENANCY_REFUSALS:
                metrics.picks.labels(pick.reason).inc()
                if response.status_code < 400:
                    out_headers["x-loraplex-worker"] = url
                    out_headers["x-loraplex-route"] = pick.reason

            async def relay(response=response, url=url):
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()
                    done(url)

            return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)
        return _error(502, "no worker answered", "bad_gateway", "server_error")

    def done(url: str) -> None:
        in_flight[url] = max(0, in_flight.get(url, 0) - 1)
        metrics.in_flight.labels(url).set(in_flight[url])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for worker in fleet.workers.values():
            if worker.healthy:
                try:
                    r = await proxy.get(f"{worker.url}/v1/models", headers=headers)
                    return Response(r.content, r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
        return _error(503, "no healthy worker", "no_worker", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if any(w.healthy for w in fleet.workers.values()):
            return {"status": "ready"}
        return _error(503, "no healthy worker", "no_worker", "server_error")

    @app.get("/metrics")
    async def metrics_page(request: Request):
        if config.metrics_token and not token_ok(request, config.metrics_token):
            return _error(401, "This endpoint needs the metrics token: send `Authorization: Bearer METRICS_TOKEN`.",
                          "invalid_metrics_token", "authentication_error")
        for worker in fleet.workers.values():
            metrics.healthy.labels(worker.url).set(1 if worker.healthy else 0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/workers")
    async def list_workers(request: Request):
        if not admin_ok(request):
            return _error(401, "admin token required", "unauthorized", "authentication_error")
        views = {v.url: v for v in fleet.views()}
        return {"workers": [{"url": w.url, "healthy": w.healthy, "kind": w.kind, "waiting": views[w.url].waiting,
                             "running": views[w.url].running, "gpu": sorted(views[w.url].gpu),
                             "in_flight": in_flight.get(w.url, 0)} for w in fleet.workers.values()]}

    @app.post("/admin/workers")
    async def add_worker(request: Request):
        if not admin_ok(request):
            return _error(401, "admin token required", "unauthorized", "authentication_error")
        body = await _json_object(request)
        if body is None:
            return _error(400, "the body must be a JSON object, e.g. {\"url\": \"http://worker:8000\"}", "invalid_json")
        url = body.get("url", "")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not _valid_url(url):
            return _error(400, "url must be an http(s) URL of a worker", "invalid_url")
        fleet.add(url)
        await fleet.poll_once()
        return {"added": url.rstrip("/")}

    @app.delete("/admin/workers")
    async def remove_worker(request: Request):
        if not admin_ok(request):
            return _error(401, "admin token required", "unauthorized", "authentication_error")
        body = await _json_object(request)
        if body is None:
            return _error(400, "the body must be a JSON object, e.g. {\"url\": \"http://worker:8000\"}", "invalid_json")
        url = body.get("url", "")
        if not fleet.remove(str(url)):
            return _error(404, f"no worker {url}", "not_found")
        return {"removed": url}

    return app


def registry_priorities(url: str) -> Callable[[str], int]:
    """Bearer key -> tenant priority, read from the registry (remembered per key for a minute)."""
    import time

    from loraplex.registry import Registry

    registry = Registry(url)
    memo: dict[str, tuple[float, int]] = {}

    tenants: list = [-math.inf, {}]  # when read, tenant -> priority

    def priority_of(key: str) -> int:
        now = time.monotonic()
        if key in memo and now - memo[key][0] < 60:
            return memo[key][1]
        try:
            if now - tenants[0] >= 60:
                tenants[:] = [now, {t.name: t.priority for t in registry.list_tenants()}]
            priority = tenants[1].get(registry.tenant_for_key(key) if key else None, 0)
        except Exception as exc:  # noqa: BLE001 (a registry problem must not fail the routing: default priority)
            log.warning("tenant priority lookup failed: %s", exc)
            priority = 0
        if len(memo) >= 10_000:  # any client can send keys: keep the memo bounded
            memo.clear()
        memo[key] = (now, priority)
        return priority

    return priority_of
