"""The gateway in front of several workers: pick a worker per request among those that can serve
it, proxy it (streaming too), retry once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplex.bearer import bearer, carries_token
from loraplex.router import cutover, model_lists
from loraplex.router.catalog import AdapterCatalog
from loraplex.router.fairness import FairQueue, QueueFull, Waiter
from loraplex.router.fleet import Fleet
from loraplex.router.holdback import Holdback, places_of
from loraplex.router.metrics import RouterMetrics
from loraplex.router.picker import Pick, Picker, PickerConfig
from loraplex.router.pools import DEFAULT_POOL, Need, PoolSpec, tiers
from loraplex.router.prefixes import block_hashes, prompt_text
from loraplex.router.routing import Refusal, Wanted, need_of, no_room, prefix_key, route
from loraplex.router.splits import Splits, split_revision
from loraplex.settings.router import DEFAULTS as D

log = logging.getLogger("loraplex.router")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
DECODED_HEADERS = HOP_HEADERS | {"content-encoding"}
"""Headers that no longer hold for a body read (and decoded) whole."""


TENANCY_REFUSALS = (401, 403, 404)
OPEN_TENANT = "default"
"""The tenant of a request without a key, as the workers name it in open mode."""


def open_caller(key: str) -> tuple[str | None, int]:
    """Without a registry: a request without a key is the open tenant's, one with a key unknown."""
    return (None if key else OPEN_TENANT), 0


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    policy: str = "affinity"
    admin_token: str | None = None
    stale_after_s: float = D.stale_after_s
    poll_interval_s: float = D.poll_interval_s
    request_timeout_s: float = D.request_timeout_s
    poll_timeout_s: float = D.poll_timeout_s
    caller_of: Callable[[str], tuple[str | None, int]] = open_caller
    """Bearer key -> (its tenant, the tenant's priority), from the registry's tenant records when
    the router has one."""
    pools: tuple[PoolSpec, ...] = ()
    """The declared pools; `workers` form the default pool beside them."""
    catalog: AdapterCatalog | None = None
    """The registry's adapters (their base models and ranks), when the router has a registry."""
    picker: PickerConfig = field(default_factory=PickerConfig)
    splits: Splits | None = None
    """The registry's split names, when the router has a registry: their revision is picked here
    (`router/splits.py`)."""
    seed: int | None = None
    metrics_token: str | None = None
    """When set, /metrics answers only `Authorization: Bearer <token>`."""
    prefix_blocks: int = D.prefix_index_blocks
    """Prompt blocks remembered per worker for prefix-aware routing (0: none)."""
    queue_per_tenant: int = D.queue_per_tenant
    """Requests a tenant may have waiting while its workers are saturated (0: no queue)."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    holdback_window_s: float = D.holdback_window_s  # `router/holdback.py`


def _error(
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    headers=None,
    param: str | None = None,
):
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


def _worker_url(url) -> bool:
    """An http(s) URL with a host."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return False
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


@dataclass
class RouterState:
    """What the router's handlers share, kept on `app.state.router`."""

    config: RouterConfig
    fleet: Fleet
    picker: Picker
    metrics: RouterMetrics
    proxy: httpx.AsyncClient
    queue: FairQueue[Pick | Refusal]
    holdback: Holdback
    uploads: itertools.count = field(default_factory=itertools.count)
    """Uploads taken: whose turn it is among equally busy workers (`cutover.upload_worker`)."""

    def admin_ok(self, request: Request) -> bool:
        token = self.config.admin_token
        return bool(token) and carries_token(request.headers.get("authorization"), token)

    def sent(
        self, url: str, adapter: str | None, prompt: tuple[int, ...] = (), tenant: str | None = None
    ) -> None:
        """A request (of `tenant`) went to the worker: open there (the picker's load) until done,
        its adapter counted as loading there until the next poll, its prompt's blocks as held."""
        self.holdback.opened(tenant, url, time.monotonic())
        worker = self.fleet.workers.get(url)
        if worker is not None:
            worker.in_flight += 1
            if adapter is not None:
                worker.sent.add(adapter)
            if prompt:
                worker.prefixes.add(prompt)
            self.metrics.in_flight.labels(url).set(worker.in_flight)

    def refused(self, url: str, adapter: str | None) -> None:
        """The worker answered the request with an error: its adapter is not loading there."""
        worker = self.fleet.workers.get(url)
        if worker is not None and adapter is not None:
            worker.sent.discard(adapter)

    def done(self, url: str, tenant: str | None = None) -> None:
        self.holdback.closed(tenant, url)
        worker = self.fleet.workers.get(url)
        if worker is not None:
            worker.in_flight = max(0, worker.in_flight - 1)
            worker.finished += 1
            self.metrics.in_flight.labels(url).set(worker.in_flight)
        self.admit()

    async def wait_turn(self, wanted: Wanted, need: Need) -> Pick | Refusal | Response:
        """The pick for a request that waits in its tenant's queue until a worker it may use has
        room and its turn comes (`router/fairness.py`); sent there already (`sent`)."""
        tenant = wanted.tenant or ""
        try:
            waiter = self.queue.join(tenant, wanted.priority, (wanted, need))
        except QueueFull:
            message = f"every worker is saturated and {self.config.queue_per_tenant} requests of "
            message += f"tenant {tenant or '(unknown)'} are waiting already"
            return _error(429, message, "saturated", "server_error", {"Retry-After": "1"})
        self.metrics.waiting.labels(tenant).set(self.queue.waiting(tenant))
        self.admit()
        try:
            return await asyncio.wait_for(waiter.granted, self.config.request_timeout_s)
        except TimeoutError:
            message = f"no worker had room within {self.config.request_timeout_s:g} s"
            return _error(503, message, "no_worker", "server_error", {"Retry-After": "1"})
        except asyncio.CancelledError:  # the client left: a pick it was granted is given back
            granted = waiter.granted
            if granted.done() and not granted.cancelled():
                pick = granted.result()
                if isinstance(pick, Pick) and pick.url is not None:
                    self.done(pick.url, tenant)
            raise
        finally:
            self.queue.leave(waiter)
            self.metrics.waiting.labels(tenant).set(self.queue.waiting(tenant))

    def admit(self) -> None:
        """Waiting requests in fair order, each while a worker it may use has room."""
        if len(self.queue):
            self.queue.admit(self._grant)

    def _grant(self, waiter: Waiter) -> Pick | Refusal | None:
        """The waiter's pick when a worker it may use has room (None: not yet), sent there."""
        wanted, need = waiter.what
        pick = route(self.fleet, self.picker, self.config.splits, need, wanted)
        if isinstance(pick, Refusal):
            return pick
        if pick.url is None or pick.reason.startswith("saturated"):
            return None
        if self.holds_back(waiter.tenant, pick):
            if not waiter.held_back:
                waiter.held_back = True
                self.metrics.held_back.labels(waiter.tenant).inc()
            return None
        self.sent(pick.url, wanted.model, wanted.prompt, waiter.tenant)
        self.metrics.granted.labels(waiter.tenant).inc()
        return pick

    def holds_back(self, tenant: str, pick: Pick) -> bool:
        workers = (w for url in pick.ranking if (w := self.fleet.workers.get(url)))
        return self.holdback.keeps_from(tenant, places_of(workers), time.monotonic())

    def pool_of(self, url: str) -> str:
        worker = self.fleet.workers.get(url)
        return worker.pool.name if worker is not None else DEFAULT_POOL


def create_router_app(config: RouterConfig) -> FastAPI:
    # No cap on connections: with httpx's default of 100 the 101st concurrent request waits for
    # one, and its PoolTimeout looks like a failed worker.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    proxy = httpx.AsyncClient(
        timeout=httpx.Timeout(config.request_timeout_s, connect=2.0), limits=limits
    )
    fleet = Fleet(
        list(config.workers),
        config.admin_token,
        config.stale_after_s,
        config.poll_interval_s,
        config.poll_timeout_s,
        config.pools,
        config.prefix_blocks if config.picker.w_prefix else 0,
    )
    picker = Picker(config.policy, config.picker, random.Random(config.seed))
    weights = dict(config.tenant_weights)
    queue: FairQueue[Pick | Refusal] = FairQueue(weights, config.queue_per_tenant)
    holdback = Holdback(config.holdback_window_s, weights)
    state = RouterState(config, fleet, picker, RouterMetrics(), proxy, queue, holdback)

    async def admitting():
        """Waiting requests go on when a poll shows room (a finished request admits at once)."""
        while True:
            await asyncio.sleep(config.poll_interval_s / 4)
            state.admit()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.fleet.poll_once()
        state.fleet.start()
        admitter = asyncio.get_running_loop().create_task(admitting())
        try:
            yield
        finally:
            admitter.cancel()
            await state.fleet.stop()
            await proxy.aclose()

    app = FastAPI(
        title="loraplex router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router, app.state.fleet, app.state.picker = state, state.fleet, state.picker
    app.include_router(routes)
    return app


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def completions(request: Request):
    return await forward(_state(request), request, "/v1/completions")


async def chat_completions(request: Request):
    return await forward(_state(request), request, "/v1/chat/completions")


async def forward(state: RouterState, request: Request, path: str):
    body = await request.body()
    try:
        payload = json.loads(body or b"{}")
    except ValueError:  # not JSON, or not UTF-8
        return _error(400, "request body is not valid JSON", "invalid_json")
    model = payload.get("model") if isinstance(payload, dict) else None
    adapter = model if isinstance(model, str) else None
    canary = False
    if adapter is not None and state.config.splits is not None:
        adapter, canary, body = split_revision(state.config.splits, payload, adapter, body)
    key = bearer(request.headers.get("authorization")) or ""
    wanted = Wanted(adapter, *state.config.caller_of(key), canary)
    tenant = wanted.tenant or ""
    wanted, pick, waited = await _routed(state, wanted, payload)
    if isinstance(pick, Response):
        return pick
    if isinstance(pick, Refusal):
        state.metrics.picks.labels("no-eligible-worker").inc()
        log.info("refused model=%s tenant=%s: %s", adapter, wanted.tenant, pick.message)
        return _error(pick.status, pick.message, pick.code, param="model")
    if pick.url is None:
        return _no_worker(state, pick)
    log.info("route model=%s worker=%s reason=%s", adapter, pick.url, pick.reason)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    for attempt, url in enumerate(pick.ranking[:2]):
        if not (waited and attempt == 0):  # a granted pick is sent there already
            state.sent(url, adapter, wanted.prompt, tenant)
        try:
            sent = state.proxy.build_request("POST", f"{url}{path}", content=body, headers=headers)
            response = await state.proxy.send(sent, stream=True)
        except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
            # The worker has the request and is slow (a non-streamed answer comes whole): neither a
            # failed worker nor one to run the generation again on.
            state.metrics.picks.labels(pick.reason).inc()
            state.done(url, tenant)
            return _error(
                504,
                f"worker {url} did not answer in time: {type(exc).__name__}",
                "gateway_timeout",
                "server_error",
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            state.done(url, tenant)
            log.warning("worker %s failed before the first byte: %s", url, exc)
            if (worker := state.fleet.workers.get(url)) is not None:
                worker.healthy = False
            if attempt == 0 and len(pick.ranking) > 1:
                state.metrics.retries.inc()
                continue
            state.metrics.picks.labels(pick.reason).inc()
            return _error(
                502, f"worker failed: {type(exc).__name__}", "bad_gateway", "server_error"
            )
        if response.status_code >= 400:
            state.refused(url, adapter)
        return _relayed(state, response, url, pick, tenant)
    return _error(502, "no worker answered", "bad_gateway", "server_error")


async def _routed(
    state: RouterState, wanted: Wanted, payload: object
) -> tuple[Wanted, Pick | Refusal | Response, bool]:
    """(the request with its prompt's blocks, its pick, whether it waited its turn for it: then
    it is sent there already)."""
    if state.fleet.prefix_blocks and isinstance(payload, dict):
        salt = prefix_key(state.config.catalog, wanted)
        wanted = dataclasses.replace(wanted, prompt=block_hashes(prompt_text(payload), salt))
    need = need_of(state.fleet, state.config.catalog, wanted)
    catalog = state.config.catalog
    if catalog is not None and wanted.model is not None and catalog.warm(wanted.model):
        wanted = dataclasses.replace(wanted, warm=True)
    pick = route(state.fleet, state.picker, state.config.splits, need, wanted)
    if isinstance(pick, Pick):  # active on the workers it may use (`router/holdback.py`)
        state.holdback.arrived(wanted.tenant, wanted.priority, time.monotonic(), pick.ranking)
    if isinstance(pick, Pick) and _waits(state, pick, wanted.tenant or ""):
        return wanted, await state.wait_turn(wanted, need), True
    return wanted, pick, False


def _waits(state: RouterState, pick: Pick, tenant: str) -> bool:
    """Whether the request waits its turn: every worker it may use is saturated, or others wait
    already (a newcomer does not pass them), or the free places are kept for other tenants."""
    if not state.config.queue_per_tenant or pick.url is None:
        return False
    saturated = pick.reason == "saturated-fallback"
    return saturated or len(state.queue) > 0 or state.holds_back(tenant, pick)


def _no_worker(state: RouterState, pick):
    """429 when every worker is saturated and the request is shed, else 503; both retry later."""
    state.metrics.picks.labels(pick.reason).inc()
    refused = no_room(pick.reason)
    return _error(
        refused.status, refused.message, refused.code, "server_error", {"Retry-After": "1"}
    )


def _relayed(state: RouterState, response: httpx.Response, url: str, pick, tenant: str):
    """The worker's answer streamed back, with the worker and the route named on a success."""
    out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
    # The pick is made from the model name alone, before any worker checks the caller's key: where
    # the worker refuses the caller (401, 403, or 404 for another tenant's adapter), neither the
    # answer nor the pick counts may tell where that adapter is resident.
    if response.status_code not in TENANCY_REFUSALS:
        state.metrics.picks.labels(pick.reason).inc()
        if response.status_code < 400:
            out_headers["x-loraplex-worker"] = url
            out_headers["x-loraplex-pool"] = state.pool_of(url)
            out_headers["x-loraplex-route"] = pick.reason
    return StreamingResponse(
        _relay(state, response, url, tenant), status_code=response.status_code, headers=out_headers
    )


async def _relay(state: RouterState, response: httpx.Response, url: str, tenant: str):
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()
        state.done(url, tenant)


async def models(request: Request):
    """Every model the caller may use on the pools open to it: each healthy worker's list, merged
    by id (a worker's own refusal of the caller, 401, when none lists any)."""
    state = _state(request)
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    tenant, _ = state.config.caller_of(bearer(headers.get("authorization")) or "")
    open_pools = {p.name for group in tiers(state.fleet.pools.values(), tenant) for p in group}
    urls = [
        w.url
        for w in state.fleet.workers.values()
        if w.healthy and w.problem is None and w.pool.name in open_pools
    ]

    async def listing(url: str) -> httpx.Response | None:
        try:
            return await state.proxy.get(f"{url}/v1/models", headers=headers)
        except httpx.HTTPError:
            return None

    answers = [r for r in await asyncio.gather(*map(listing, urls)) if r is not None]
    listed = [_models_of(r) for r in answers if r.status_code == 200]
    if listed:
        return model_lists.merged(listed)
    if answers:
        refusal = answers[0]
        return Response(refusal.content, refusal.status_code, media_type="application/json")
    return _error(503, "no healthy worker", "no_worker", "server_error")


def _models_of(answer: httpx.Response) -> list[dict]:
    """The entries of a worker's `/v1/models` list (none from an answer of another shape)."""
    try:
        return model_lists.entries(answer.json())
    except ValueError:
        return []


async def health():
    return {"status": "ok"}


async def ready(request: Request):
    if any(w.healthy for w in _state(request).fleet.workers.values()):
        return {"status": "ready"}
    return _error(503, "no healthy worker", "no_worker", "server_error")


async def metrics_page(request: Request):
    state = _state(request)
    token = state.config.metrics_token
    if token and not carries_token(request.headers.get("authorization"), token):
        return _error(
            401,
            "This endpoint needs the metrics token: send `Authorization: Bearer METRICS_TOKEN`.",
            "invalid_metrics_token",
            "authentication_error",
        )
    for worker in state.fleet.workers.values():
        state.metrics.healthy.labels(worker.url).set(1 if worker.healthy else 0)
        misfit = 1 if worker.problem is not None else 0
        state.metrics.misconfigured.labels(worker.url, worker.pool.name).set(misfit)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


ADMIN_REFUSAL = (401, "admin token required", "unauthorized", "authentication_error")
URL_BODY_HINT = 'the body must be a JSON object, e.g. {"url": "http://worker:8000"}'


async def list_workers(request: Request):
    state = _state(request)
    if not state.admin_ok(request):
        return _error(*ADMIN_REFUSAL)
    views = {v.url: v for v in state.fleet.views()}
    return {
        "workers": [
            {
                "url": w.url,
                "pool": w.pool.name,
                "healthy": w.healthy,
                "misconfigured": w.problem,
                "base_model": w.reported.base_model,
                "base_model_digest": w.reported.base_model_digest,
                "max_lora_rank": w.reported.max_lora_rank,
                "kind": w.kind,
                "waiting": views[w.url].waiting,
                "running": views[w.url].running,
                "gpu": sorted(views[w.url].gpu),
                "in_flight": w.in_flight,
                "placed": sorted(w.placed),
                "drain": w.drain,
                "generation": w.generation,
                "state_bytes": w.state_bytes,
            }
            for w in state.fleet.workers.values()
        ]
    }


async def add_worker(request: Request):
    state = _state(request)
    if not state.admin_ok(request):
        return _error(*ADMIN_REFUSAL)
    body = await _json_object(request)
    if body is None:
        return _error(400, URL_BODY_HINT, "invalid_json")
    url, pool = body.get("url", ""), body.get("pool", DEFAULT_POOL)
    if not _worker_url(url):
        return _error(400, "url must be an http(s) URL of a worker", "invalid_url")
    if not isinstance(pool, str) or pool not in state.fleet.pools:
        pools = ", ".join(state.fleet.pools)
        message = f"no pool {pool!r}: the pools are {pools}"
        return _error(400, message, "invalid_value", param="pool")
    worker = state.fleet.add(url, pool)
    await state.fleet.poll_once()
    return {"added": url.rstrip("/"), "pool": worker.pool.name}


async def remove_worker(request: Request):
    state = _state(request)
    if not state.admin_ok(request):
        return _error(*ADMIN_REFUSAL)
    body = await _json_object(request)
    if body is None:
        return _error(400, URL_BODY_HINT, "invalid_json")
    url = body.get("url", "")
    if not state.fleet.remove(str(url)):
        return _error(404, f"no worker {url}", "not_found")
    return {"removed": url}


async def upload(request: Request):
    """An adapter upload (`POST /admin/adapters/{name}/upload`) streamed on to a healthy worker of
    the name's pools (`cutover.upload_worker`): the workers share the registry, so the revision it
    registers is the fleet's. The
    caller's admin token goes with it (the workers' admin token). With `?wait=ready&timeout=S`,
    the answer waits for every worker of the revision's pools to hold it (`router/cutover.py`)."""
    state = _state(request)
    if not state.admin_ok(request):
        return _error(*ADMIN_REFUSAL)
    try:
        wait_s = cutover.wait_of(dict(request.query_params))
    except ValueError as exc:
        return _error(400, str(exc), "invalid_value", param="wait")
    name = request.path_params["name"]
    url = cutover.upload_worker(state.fleet, state.config.catalog, name, next(state.uploads))
    if url is None:
        return _error(
            503,
            "no healthy worker to take the upload",
            "no_worker",
            "server_error",
            {"Retry-After": "1"},
        )
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("wait", "timeout")]
    upstream = state.proxy.build_request(
        "POST", f"{url}{request.url.path}", params=params, content=request.stream(), headers=headers
    )
    began = time.perf_counter()
    state.sent(url, None)
    try:  # the answer is one record, read whole: the worker's count ends however the caller goes
        response = await state.proxy.send(upstream)
    except httpx.HTTPError as exc:
        log.warning("worker %s failed during an upload: %s", url, exc)
        return _error(502, f"worker failed: {type(exc).__name__}", "bad_gateway", "server_error")
    finally:
        state.done(url)
    if wait_s is None or response.status_code != 200:
        kept = {k: v for k, v in response.headers.items() if k.lower() not in DECODED_HEADERS}
        return Response(response.content, status_code=response.status_code, headers=kept)
    record = response.json()
    urls = cutover.pool_workers(state.fleet, record)
    token = state.config.admin_token or ""
    record["cutover"] = await cutover.wait_ready(state.proxy, urls, token, record, wait_s)
    if record["cutover"]["ready"]:
        state.metrics.publish_ready.observe(time.perf_counter() - began)
    return record


routes = APIRouter()
routes.add_api_route("/v1/completions", completions, methods=["POST"])
routes.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
routes.add_api_route("/v1/models", models, methods=["GET"])
routes.add_api_route("/health", health, methods=["GET"])
routes.add_api_route("/ready", ready, methods=["GET"])
routes.add_api_route("/metrics", metrics_page, methods=["GET"])
routes.add_api_route("/admin/workers", list_workers, methods=["GET"])
routes.add_api_route("/admin/workers", add_worker, methods=["POST"])
routes.add_api_route("/admin/workers", remove_worker, methods=["DELETE"])
routes.add_api_route("/admin/adapters/{name}/upload", upload, methods=["POST"])
