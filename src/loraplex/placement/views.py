"""What the placement policy plans from: each worker as its `/admin/state` says (its pool, base
model digest, max rank, slots, host bytes, drain, the adapters placed there and the demand of its
window), and each registered adapter's serving revision as the registry says."""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.placement.policy import AdapterView, WorkerView
from loraplex.registry.records import AdapterRecord
from loraplex.residency.policy import DEMAND_WINDOWS_S
from loraplex.settings.pools import PoolSpec

DEMAND_WINDOW_S = DEMAND_WINDOWS_S[0]
"""A worker's `demand_5m` is a count decayed over this window: over it, requests per second."""
UNBOUNDED_BYTES = 2**62


def worker_view(url: str, pool: PoolSpec, state: dict) -> WorkerView:
    """A worker from its whole `GET /admin/state`; adapters by key `name@revision`."""
    demand: dict[str, float] = {}
    for a in state.get("adapters", []):
        key = f"{a['name']}@{a['revision']}"
        demand[key] = demand.get(key, 0.0) + a.get("demand_5m", 0.0) / DEMAND_WINDOW_S
    load, cache = state.get("load", {}), state.get("cache", {})
    return WorkerView(
        name=url,
        pool=pool.name,
        base=state.get("base_model_digest") or "",
        max_rank=state.get("max_lora_rank") or 0,
        slots=load.get("num_slots", 0),
        host_bytes=host_bytes(cache),
        draining=state.get("drain") is not None,
        placed=frozenset(state.get("placed") or ()),
        demand=demand,
        tenants=frozenset(pool.tenants),
    )


def host_bytes(cache: dict) -> int:
    """The bytes of adapters the worker's host memory holds: the native engine's capacity; the
    vLLM engine counts its host cache in adapters (`cpu_loras_capacity`), at least its device
    slots, so there the slots bound placement and the bytes do not."""
    if "cpu_bytes_capacity" in cache:
        return int(cache["cpu_bytes_capacity"])
    return UNBOUNDED_BYTES if cache.get("cpu_loras_capacity") else 0


def adapter_views(adapters: Iterable[AdapterRecord]) -> dict[str, AdapterView]:
    """Each serving revision of each adapter, by key `name@revision`."""
    views = {}
    for adapter in adapters:
        for r in adapter.revisions:
            if r.traffic_weight:
                views[r.model_id] = AdapterView(
                    key=r.model_id,
                    base=r.base_model_digest or "",
                    rank=r.rank,
                    nbytes=r.actual_bytes or r.estimated_bytes,
                    tenant=None if adapter.shared else adapter.owner_tenant,
                )
    return views
