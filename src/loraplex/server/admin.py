"""The admin API under /admin/ (bearer admin token), and vLLM's load/unload endpoints behind the
same token.

Registry changes run in a worker thread (they are blocking database calls); cache operations are
quick.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from loraplex.artifacts import UnsafeLocation, artifact_files, fetch_artifact
from loraplex.registry import AdapterNotFound, RegistryError, ReleaseChecks, RevisionRecord
from loraplex.residency.errors import AdapterInFlight, CapacityExceeded
from loraplex.residency.key import AdapterKey
from loraplex.server import cutover, publish
from loraplex.server.auth import admin_router
from loraplex.server.errors import APIError
from loraplex.server.rollout_admin import EVAL_MAX_TOKENS
from loraplex.server.state_feed import Generation, StateFeed
from loraplex.units import parse_size

if TYPE_CHECKING:
    from loraplex.server.server import Server

Tier = Literal["gpu", "cpu"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterBody(_Body):
    name: str
    path: str | None = None
    storage_uri: str | None = None
    digest: str | None = None
    revision: str | None = None
    tenant: str | None = None
    shared: bool | None = None
    warm: Literal["gpu", "cpu", "on_demand"] | None = None
    priority: int | None = None
    stable: bool = False
    signature: str | None = None
    """ed25519:<base64> over the digest; without it, DIR/adapter.sig when the path has one."""


class PromoteBody(_Body):
    revision: str
    weight: int = 100
    force: bool = False


class TrafficBody(_Body):
    weights: dict[str, int]
    force: bool = False


class TierBody(_Body):
    tier: Tier = "cpu"
    revision: str | None = None


class PrewarmBody(TierBody):
    wait_s: float | None = None
    """Wait up to this many seconds for each copy to be loaded, and answer its readiness."""


class RevisionBody(_Body):
    revision: str | None = None


class BudgetBody(_Body):
    """The fields given are set (null clears one: the server's default share); those left out
    stay."""

    max_gpu_slots: int | None = None
    max_cpu_bytes: int | str | None = None
    """Bytes, or a size such as 512MiB."""


class LoadLoraBody(BaseModel):
    # vLLM's request; other extra fields are ignored as vLLM does
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """Replace the weights of a loaded name: a new revision takes all of its traffic."""


class UnloadLoraBody(BaseModel):
    lora_name: str


def router(token: str) -> APIRouter:
    r = admin_router(token)
    feed = StateFeed()

    async def admin_state(request: Request) -> Response:
        return await state(request, feed)

    r.add_api_route("/admin/state", admin_state, methods=["GET"])
    r.add_api_route("/admin/adapters", register, methods=["POST"])
    r.add_api_route("/admin/adapters", list_adapters, methods=["GET"])
    r.add_api_route("/admin/adapters/{name}", show, methods=["GET"])
    r.add_api_route("/admin/adapters/{name}/upload", publish.upload, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/promote", promote, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/traffic", set_traffic, methods=["PUT"])
    r.add_api_route("/admin/adapters/{name}/rollback", rollback, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/pin", pin, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/unpin", unpin, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/prewarm", prewarm, methods=["POST"])
    r.add_api_route("/admin/adapters/{name}/evict", evict, methods=["POST"])
    r.add_api_route("/admin/tenants/{tenant}/budget", set_budget, methods=["PUT"])
    r.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    r.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    return r


def _server(request: Request) -> Server:
    return request.app.state.server


# ---- reading -------------------------------------------------------------------------------------


async def state(request: Request, feed: StateFeed) -> Response:
    """The whole state; or with `view=routing` the routing view, numbered: `since=GENERATION` gives
    only what changed after it, and `If-None-Match` with the current generation a 304."""
    full = await run_in_threadpool(_server(request).state)  # a look per adapter: off the loop
    generation = feed.observe(full)
    view = request.query_params.get("view")
    if view is None:
        return JSONResponse({**full, "generation": str(generation)})
    if view != "routing":
        raise APIError(400, f"view {view!r}: the one view is routing", "invalid_value", "view")
    headers = {"ETag": generation.etag, "Cache-Control": "no-cache"}
    if Generation.parse(request.headers.get("if-none-match", "")) == generation:
        return Response(status_code=304, headers=headers)
    since = request.query_params.get("since")
    held = None if since is None else Generation.parse(since)
    if since is not None and held is None:
        raise APIError(
            400,
            f"since {since!r}: give a generation (EPOCH.N) from an earlier answer",
            "invalid_value",
            "since",
        )
    return JSONResponse(feed.view(held), headers=headers)


async def set_budget(tenant: str, body: BudgetBody, request: Request) -> dict:
    """Set a tenant's residency budgets in the registry and apply them here at once (other servers
    follow within their watch interval). A negative value, one that is not a size, or one beyond
    this server's capacity is refused, naming the field, and nothing changes."""
    server = _server(request)
    cache = server.engine.adapters
    capacity = {
        "max_gpu_slots": (cache.budgets.gpu_slots, "slots"),
        "max_cpu_bytes": (cache.budgets.cpu_bytes, "bytes"),
    }
    budget = {}
    for field_name in sorted(body.model_fields_set):
        value = getattr(body, field_name)
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise APIError(400, f"{field_name}: {exc}", "invalid_value", field_name) from None
        limit, unit = capacity[field_name]
        if value is not None and value < 0:
            raise APIError(
                400, f"{field_name} must be >= 0, not {value}", "invalid_value", field_name
            )
        if value is not None and value > limit:
            raise APIError(
                400,
                f"{field_name} {value} is more than this server's {limit} {unit}",
                "invalid_value",
                field_name,
            )
        budget[field_name] = value
    await run_in_threadpool(server.registry.set_budget, tenant, **budget)  # an unknown tenant: 404
    await run_in_threadpool(server.apply_budgets)
    row = cache.budget_state().get(tenant)
    return {"tenant": tenant, **(row or {})}


async def list_adapters(request: Request) -> dict:
    adapters = await run_in_threadpool(_server(request).registry.list_adapters)
    return {"adapters": [a.to_dict() for a in adapters]}


async def show(name: str, request: Request) -> dict:
    server = _server(request)
    adapter = await run_in_threadpool(server.registry.show, name)
    resident = [a for a in server.engine.adapters.state()["adapters"] if a["name"] == name]
    return {**adapter.to_dict(), "residency": resident}


# ---- registry changes ----------------------------------------------------------------------------


async def register(body: RegisterBody, request: Request) -> dict:
    """From a directory inside the allowed roots, or a storage URI (with its digest) under an
    allowed prefix."""
    server = _server(request)
    if (body.path is None) == (body.storage_uri is None):
        raise APIError(400, "give exactly one of path and storage_uri", "invalid_value", "path")
    record = await run_in_threadpool(_register, server, body)
    await run_in_threadpool(server.pins.warm_name, record.name)  # its pin or warm policy
    return record.to_dict()


def _register(server: Server, body: RegisterBody) -> RevisionRecord:
    if body.path is not None:
        src = _allowed_dir(server, body.path)
    else:
        if body.digest is None:
            raise APIError(
                400, "a storage_uri needs its digest (sha256:...)", "invalid_value", "digest"
            )
        store = server.registry.store
        if store is None:  # refused as `add_revision` refuses it
            raise RegistryError(
                "no artifact store configured for this registry (pass store=ArtifactStore(DIR))"
            )
        assert body.storage_uri is not None  # exactly one of path and storage_uri (`register`)
        src = fetch_artifact(body.storage_uri, body.digest, store, server.allowed)
    return server.registry.add_revision(
        src,
        body.name,
        revision=body.revision,
        tenant=body.tenant,
        shared=body.shared,
        base_model_dir=server.engine.model_dir,
        warm_policy=body.warm,
        priority=body.priority,
        status="stable" if body.stable else "staging",
        digest=body.digest,
        signature=body.signature,
    )


def _allowed_dir(server: Server, path: str) -> Path:
    """The directory, if it and every artifact file in it (symlinks followed) lie inside an allowed
    root."""
    src = Path(path)
    if not src.is_absolute():
        raise UnsafeLocation(f"{path}: give an absolute path")
    root = server.allowed.root_for(src.resolve().as_uri())
    if src.is_dir():
        for name in artifact_files(src):
            if not (src / name).resolve().is_relative_to(root):
                raise UnsafeLocation(f"{src / name} is a symlink out of the allowed root {root}")
    return src


async def promote(name: str, body: PromoteBody, request: Request) -> dict:
    server = _server(request)
    checks = _release_checks(server, asyncio.get_running_loop())
    adapter = await run_in_threadpool(
        server.registry.promote, name, body.revision, body.weight, checks, body.force
    )
    await run_in_threadpool(server.follow_traffic)  # pins move to the revisions now serving
    return adapter.to_dict()


async def set_traffic(name: str, body: TrafficBody, request: Request) -> dict:
    server = _server(request)
    checks = _release_checks(server, asyncio.get_running_loop())
    adapter = await run_in_threadpool(
        server.registry.set_traffic, name, body.weights, checks, body.force
    )
    await run_in_threadpool(server.follow_traffic)
    return adapter.to_dict()


async def rollback(name: str, request: Request) -> dict:
    server = _server(request)
    adapter = await run_in_threadpool(server.registry.rollback, name)
    await run_in_threadpool(server.follow_traffic)
    return adapter.to_dict()


def _release_checks(server: Server, loop: asyncio.AbstractEventLoop) -> ReleaseChecks:
    """Prewarm into cpu, complete prompts and score a parity reference's tokens with the revision
    itself (and the base model), on this server's engine."""

    def prewarm(record: RevisionRecord) -> None:
        server.engine.adapters.prewarm(server.resolver.ref_for(record), "cpu")

    def complete(record: RevisionRecord, prompt: str) -> str:
        ref = server.resolver.ref_for(record)
        completion = server.engine.complete_text(prompt, ref, max_tokens=EVAL_MAX_TOKENS)
        return asyncio.run_coroutine_threadsafe(completion, loop).result(timeout=120)

    def score(record: RevisionRecord | None, ids: list[int]) -> list[float]:
        ref = server.resolver.ref_for(record) if record is not None else None
        scored = server.engine.score_tokens(ids, ref)
        return asyncio.run_coroutine_threadsafe(scored, loop).result(timeout=120)

    pass_rate = server.config.settings.release_min_pass_rate
    return ReleaseChecks(prewarm=prewarm, complete=complete, min_pass_rate=pass_rate, score=score)


# ---- cache operations ----------------------------------------------------------------------------


async def revisions_named(server: Server, name: str, revision: str | None) -> list[RevisionRecord]:
    """The named revision, or every revision in traffic."""
    if revision is not None:
        return [await run_in_threadpool(server.registry.get_revision, name, revision)]
    adapter = await run_in_threadpool(server.registry.show, name)
    serving = [r for r in adapter.revisions if r.traffic_weight]
    if not serving:
        raise APIError(
            409, f"{name} has no revision in traffic; name one", "lifecycle_conflict", "revision"
        )
    return serving


def _resident_keys(server: Server, name: str, revision: str | None = None) -> list[AdapterKey]:
    return [
        AdapterKey(a["base_model_digest"], a["name"], a["revision"], a["digest"])
        for a in server.engine.adapters.state()["adapters"]
        if a["name"] == name and revision in (None, a["revision"])
    ]


PIN_LOAD_WAIT_S = 30.0
FORGET_WAIT_S = 2.0
"""How long an unload waits for the engine's step to give back an aborted request's slot."""


async def pin(name: str, request: Request, body: TierBody | None = None) -> dict:
    body = body or TierBody()  # no body: every default
    server = _server(request)
    records = await revisions_named(server, name, body.revision)
    for record in records:  # a digest's files, read off the loop
        await server.resolver.prepare(record)
    cache = server.engine.adapters
    refs = [server.resolver.ref_for(record, record.owner_tenant or "default") for record in records]
    before = {r.key: cache.pinned(r.key) for r in refs}

    def undo() -> None:  # a refused call leaves every pin as it was
        for ref in refs:
            cache.restore_pin(ref.key, before[ref.key])

    try:
        for ref in refs:
            cache.pin(ref, body.tier)  # CapacityExceeded → 409
    except CapacityExceeded:
        undo()
        raise
    still_loading = []
    if body.tier == "cpu":
        # An adapter never loaded has no known size: its cpu pin is checked when the load lands.
        # Wait for that, so that a pin the budget cannot hold is refused here rather than dropped
        # later with only a log line.
        loads = [asyncio.wrap_future(cache.when_loaded(r.key)) for r in refs]
        if loads:
            await asyncio.wait(loads, timeout=PIN_LOAD_WAIT_S)
        landed = [r for r in refs if not cache.is_loading(r.key)]
        refused = [r for r in landed if cache.pinned(r.key) != "cpu"]
        if refused:
            undo()
            raise APIError(
                409,
                f"cannot pin {', '.join(str(r.key) for r in refused)} to cpu: with its bytes, "
                "pinned adapters would exceed cpu_cache_bytes",
                "capacity_exceeded",
            )
        failed = [r for r in landed if not cache.in_host_memory(r.key)]
        if failed:  # its load failed (logged with the cause): nothing is pinned
            undo()
            raise APIError(
                503,
                f"cannot pin {', '.join(str(r.key) for r in failed)}: its load failed",
                "adapter_unavailable",
            )
        still_loading = [str(r.key) for r in refs if cache.is_loading(r.key)]
    if body.revision is None:  # the name's pin: it follows traffic to the revisions promoted later
        await run_in_threadpool(server.registry.pin, name, True, body.tier)
        await run_in_threadpool(server.pins.warm_name, name)
    else:  # this revision's: an operator's, traffic does not move it
        await run_in_threadpool(server.pins.operator_pinned, [r.key for r in refs], name, body.tier)
    return {"pinned": [r.model_id for r in records], "tier": body.tier, "loading": still_loading}


async def unpin(name: str, request: Request) -> dict:
    server = _server(request)
    await run_in_threadpool(server.registry.unpin, name)
    keys = _resident_keys(server, name)
    for key in keys:
        server.engine.adapters.unpin(key)
    server.pins.released(keys)
    return {"unpinned": [str(k) for k in keys]}


async def prewarm(name: str, request: Request, body: PrewarmBody | None = None) -> dict:
    """Start the loads of the revision (or the revisions in traffic); with `wait_s`, wait for
    them and answer each one's readiness (`cutover.ready_here`)."""
    body = body or PrewarmBody()  # no body: every default
    server = _server(request)
    records = await revisions_named(server, name, body.revision)
    if body.wait_s is not None:
        cutover.check_wait_s(body.wait_s, "wait_s")
        rows = [
            await cutover.ready_here(server, r.name, r.revision, body.tier, body.wait_s)
            for r in records
        ]
        return {"prewarming": [r.model_id for r in records], "tier": body.tier, "ready": rows}
    for record in records:
        await server.resolver.prepare(record)  # a digest's files, read off the loop
        server.engine.adapters.prewarm(
            server.resolver.ref_for(record, record.owner_tenant or "default"), body.tier
        )
    return {"prewarming": [r.model_id for r in records], "tier": body.tier}


async def evict(name: str, request: Request, body: RevisionBody | None = None) -> dict:
    body = body or RevisionBody()  # no body: every default
    server = _server(request)
    cache = server.engine.adapters
    keys = _resident_keys(server, name, body.revision)
    was_pinned = any(cache.pinned(k) for k in keys)
    for key in keys:
        cache.evict(key)  # AdapterInFlight → 409; drops its pin
        server.pins.released([key])
    if was_pinned and not any(cache.pinned(k) for k in _resident_keys(server, name)):
        # else the next start would pin it again
        await run_in_threadpool(server.registry.unpin, name)
    return {"evicted": [str(k) for k in keys]}


async def _forget(server: Server, key: AdapterKey) -> None:
    """An aborted request gives its slot reference back on the engine's next step: wait for that
    (at most FORGET_WAIT_S; then AdapterInFlight)."""
    cache = server.engine.adapters
    await asyncio.wait([asyncio.wrap_future(cache.when_released(key))], timeout=FORGET_WAIT_S)
    cache.forget(key)


# ---- vLLM's dynamic LoRA endpoints ---------------------------------------------------------------


async def load_lora_adapter(body: LoadLoraBody, request: Request) -> PlainTextResponse:
    """Register a directory inside the allowed roots as a shared adapter serving all of its name's
    traffic; a name already loaded is refused, unless `load_inplace` asks for its new weights (a
    new revision, its previous ones kept as the name's `keep` says)."""
    server = _server(request)
    await run_in_threadpool(_load, server, body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


def _load(server: Server, body: LoadLoraBody) -> None:
    src = _allowed_dir(server, body.lora_path)
    try:
        existing = server.registry.show(body.lora_name)
    except AdapterNotFound:
        existing = None
    if existing is not None and not existing.shared:
        raise APIError(
            400,
            f"{body.lora_name} belongs to tenant {existing.owner_tenant}; pick another name",
            "invalid_value",
            "lora_name",
        )
    if existing is not None and existing.traffic and not body.load_inplace:
        raise APIError(
            400,
            f"The lora adapter '{body.lora_name}' has already been loaded.",
            "invalid_value",
            "lora_name",
        )
    record = server.registry.add_revision(
        src,
        body.lora_name,
        shared=True,
        base_model_dir=server.engine.model_dir,
        status="stable",
        fast_path=body.load_inplace,
    )
    if record.traffic_weight != 100:
        # the same bytes as an earlier revision, which had left traffic
        server.registry.promote(body.lora_name, record.revision, 100, force=True)


async def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> PlainTextResponse:
    """Drain: new requests get 404 at once, those in flight finish; then the adapter leaves traffic
    and memory."""
    server = _server(request)
    name = body.lora_name
    try:
        adapter = await run_in_threadpool(server.registry.show, name)
    except AdapterNotFound:
        adapter = None
    if adapter is None or not adapter.traffic or not adapter.shared:
        raise APIError(
            404, f"The lora adapter '{name}' cannot be found.", "model_not_found", "lora_name"
        )
    try:
        timeout_s = server.config.settings.unload_timeout_s
        if not await server.resolver.drain(name, timeout_s):
            raise AdapterInFlight(
                f"{name} still has requests in flight after {timeout_s} s; "
                "it stays loaded, retry the unload"
            )
        # before the deprecation is seen: the pins do not keep an unloaded name warm for its grace
        server.resolver.unloaded.add(name)
        try:
            await run_in_threadpool(server.registry.deprecate, name)
        except BaseException:
            server.resolver.unloaded.discard(name)
            raise
        for key in _resident_keys(server, name):
            await _forget(server, key)
    finally:
        server.resolver.draining.discard(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
