"""What the placement controller asks of a worker through the admin API: keep a name's serving
revisions warm here (`POST /admin/placement/{name}`), let them go (`DELETE`), and drain the worker
before it leaves (`POST /admin/drain`).

A placement pin is this worker's alone: unlike `/admin/adapters/{name}/pin`, it writes nothing to
the registry, so no other worker follows it. The names placed here and the drain are in the
worker's state (`placed`, `drain`), where the router and the controller read them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from loraplex.residency.key import AdapterKey
from loraplex.server.admin import PIN_LOAD_WAIT_S, TierBody, revisions_named
from loraplex.server.auth import admin_router
from loraplex.server.errors import APIError

if TYPE_CHECKING:
    from loraplex.server.server import Server


def router(token: str) -> APIRouter:
    r = admin_router(token)
    r.add_api_route("/admin/placement/{model}", place, methods=["POST"])
    r.add_api_route("/admin/placement/{model}", release, methods=["DELETE"])
    r.add_api_route("/admin/drain", drain, methods=["POST"])
    r.add_api_route("/admin/drain", undrain, methods=["DELETE"])
    return r


def _server(request: Request) -> Server:
    return request.app.state.server


async def place(model: str, request: Request, body: TierBody | None = None) -> dict:
    """Pin `name@revision` (a bare name: its serving revisions) here in `tier`, once loaded (at
    most PIN_LOAD_WAIT_S): 409 beyond capacity or while draining, 503 when the load fails;
    nothing is placed then."""
    body = body or TierBody()
    server = _server(request)
    if server.placement.draining:
        raise APIError(409, "this worker is draining: place the adapter elsewhere", "draining")
    name, _, revision = model.partition("@")
    records = await revisions_named(server, name, revision or body.revision)
    cache = server.engine.adapters
    refs = []
    for record in records:
        await server.resolver.prepare(record)  # a digest's files, read off the loop
        refs.append(server.resolver.ref_for(record, record.owner_tenant or "default"))
    before = {ref.key: cache.pinned(ref.key) for ref in refs}
    try:
        for ref in refs:
            cache.pin(ref, body.tier)  # CapacityExceeded → 409
        loads = [asyncio.wrap_future(cache.when_loaded(ref.key)) for ref in refs]
        if loads:
            await asyncio.wait(loads, timeout=PIN_LOAD_WAIT_S)
        landed = [r for r in refs if not cache.is_loading(r.key)]
        refused = [r for r in landed if cache.pinned(r.key) != body.tier]
        if refused:
            raise APIError(409, f"cannot place {refused[0].key}: no room", "capacity_exceeded")
        failed = [r for r in landed if cache.tier_of(r.key) not in ("gpu", "cpu")]
        if failed:
            raise APIError(
                503, f"cannot place {failed[0].key}: its load failed", "adapter_unavailable"
            )
    except BaseException:
        for ref in refs:
            cache.restore_pin(ref.key, before[ref.key])
        raise
    for ref in refs:
        server.placement.add(ref.key, body.tier)
    return {"placed": [r.model_id for r in records], "tier": body.tier}


async def release(model: str, request: Request) -> dict:
    """Drop the placement pins of `name@revision` (a bare name: of each of its revisions) here;
    a pin an operator or the registry made stays."""
    server = _server(request)
    released = []
    for key, tier in server.placement.pop(model):
        if cache_pin_is_placements(server, key, tier):
            server.engine.adapters.unpin(key)
        released.append(f"{key.name}@{key.revision}")
    return {"released": released}


def cache_pin_is_placements(server: Server, key: AdapterKey, tier: str) -> bool:
    """Whether the key's pin is the placement's: in its tier and held by no pin rule."""
    return server.engine.adapters.pinned(key) == tier and not server.pins.holds(key)


async def drain(request: Request) -> dict:
    """No new placement here; the state says `drain: draining` until the controller has moved
    every name placed here and no request is in flight (`drained`)."""
    server = _server(request)
    server.placement.draining = True
    return server.placement.state(server.admission.num_in_flight)


async def undrain(request: Request) -> dict:
    server = _server(request)
    server.placement.draining = False
    return server.placement.state(server.admission.num_in_flight)
