"""An adapter's row of `GET /admin/state`, the same for both engines (the ledger's `state`)."""

from __future__ import annotations

from loraplex.residency.key import AdapterKey
from loraplex.residency.policy import DemandTracker


def adapter_row(
    key: AdapterKey,
    entry,
    tier: str,
    loading: bool,
    warm: str | None,
    demand: DemandTracker,
    now: float,
) -> dict:
    """`entry`: the cache's Entry or the residency's Resident (the same counters). `warm`: "A" in
    the gpu warm set, "B" in the cpu warm set, None in neither."""
    return {
        "name": key.name,
        "revision": key.revision,
        "digest": key.adapter_digest,
        "base_model_digest": key.base_model_digest,
        "tenant": entry.ref.tenant,
        "charged_to": sorted(entry.charged),
        "tier": tier,
        "loading": loading,
        "bytes": entry.nbytes,
        "pinned": entry.pinned,
        "in_flight": entry.refcount,
        "hits": entry.hits,
        "loads": entry.loads,
        "evictions": entry.evictions,
        "last_access_s_ago": round(now - entry.last_access, 3),
        "demand_5m": round(demand.short(key, now), 3),
        "warm": warm,
    }
