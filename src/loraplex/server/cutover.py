"""A revision's readiness on this worker, for a publish that waits for the fleet's cutover: the
catalog brought up to the registry's latest commit (so that `name@rev` resolves here), the copy
loaded into host memory (`prewarm`), and its tier reported. What a router asks of each worker of
a pool (`POST /admin/adapters/{name}/prewarm` with `wait_s`), and what an upload with
`?wait=ready` asks of the worker that took it."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from loraplex.registry import RevisionRecord
from loraplex.residency.key import AdapterKey
from loraplex.server.errors import APIError

if TYPE_CHECKING:
    from loraplex.server.server import Server

READY_TIERS = ("gpu", "cpu")
"""Where a copy must be for its revision to count as ready: in a slot or in host memory."""
MAX_WAIT_S = 3600.0
"""The longest a prewarm or an upload waits for readiness."""


def check_wait_s(wait_s: float, param: str) -> None:
    if not 0 < wait_s <= MAX_WAIT_S:
        raise APIError(
            400, f"{param} must be more than 0 and at most {MAX_WAIT_S} s", "invalid_value", param
        )


async def ready_here(server: Server, name: str, revision: str, tier: str, wait_s: float) -> dict:
    """{"model", "ready", "tier", "error", "seconds"} of `name@revision` on this worker, once its
    copy is in `tier` (or host memory) or its load failed, or after `wait_s` seconds."""
    began = time.perf_counter()
    await asyncio.to_thread(server.catalog.refresh)
    record = _listed(server, name, revision)
    error = None
    if record is None:
        error = f"{name}@{revision} is not servable here (not in the registry, or retired)"
    elif (problem := server.resolver.signature_problem(record)) is not None:
        error = problem
    else:
        error = await _load(server, record, tier, wait_s)
    current = None
    if record is not None:
        key = AdapterKey(server.resolver.base_model_digest, name, revision, record.digest)
        current = server.engine.adapters.tier_of(key)
    return {
        "model": f"{name}@{revision}",
        "ready": error is None,
        "tier": current,
        "error": error,
        "seconds": round(time.perf_counter() - began, 4),
    }


def _listed(server: Server, name: str, revision: str) -> RevisionRecord | None:
    adapter = server.catalog.adapter(name)
    if adapter is None:
        return None
    return next((r for r in adapter.revisions if r.revision == revision), None)


async def _load(server: Server, record: RevisionRecord, tier: str, wait_s: float) -> str | None:
    """Prewarm the revision into `tier` and wait for its load; None once its copy is in a slot or
    in host memory, else why not."""
    cache = server.engine.adapters
    try:
        await server.resolver.prepare(record)  # a digest's files, read off the loop
        ref = server.resolver.ref_for(record, record.owner_tenant or "default")
        cache.prewarm(ref, tier)
    except Exception as exc:  # noqa: BLE001 (reported per worker: the fleet's other workers go on)
        return f"{type(exc).__name__}: {exc}"
    deadline = time.monotonic() + wait_s
    while True:
        loading = asyncio.wrap_future(cache.when_loaded(ref.key))
        await asyncio.wait([loading], timeout=max(0.0, deadline - time.monotonic()))
        if cache.tier_of(ref.key) in READY_TIERS:
            return None
        if not cache.is_loading(ref.key):
            return (
                "its copy is not in host memory after its load: the load failed (the worker's "
                "log, loraplex_adapter_load_failures_total) or found no room"
            )
        if time.monotonic() >= deadline:
            return f"still loading after {wait_s} s"


async def cutover_here(server: Server, url: str, record: dict, wait_s: float) -> dict:
    """The cutover of an upload that waits on the worker that took it: this worker only."""
    began = time.perf_counter()
    row = await ready_here(server, record["name"], record["revision"], "cpu", wait_s)
    return {
        "ready": row["ready"],
        "seconds": round(time.perf_counter() - began, 4),
        "workers": [{"worker": url, **row}],
    }
