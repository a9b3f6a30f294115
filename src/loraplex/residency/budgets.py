"""Per-tenant residency budgets as placement rules over plain data: no torch, no cache mechanism.

Every engine applies the same rule to its own tiers: the native cache to its device slots and host
copies, a vLLM engine to vLLM's host cache and pinned set. The caller describes what is resident as
plain pairs of `(key, charged tenants)` and per-tenant usage counts; the rule answers which keys a
tenant may displace, whether it may take a place at all, and whether its waiting requests give way
to other tenants'.

The rule:
- A resident adapter counts for each tenant whose requests hold it now, else for the tenant whose
  request used it last (`charged`): a shared adapter counts in full for every tenant using it.
- Free capacity (an empty slot, unused host bytes) is taken by anyone, over budget or not, while
  no other tenant's request waits for it: a budget limits what a tenant takes from the others,
  never what no one uses. A budget of zero is served only from free capacity.
- A tenant whose usage plus what it asks for would go beyond its budget makes room only from the
  adapters that count for it alone (`victims`), or waits: it never evicts what counts for another
  tenant.
- A tenant within its budget evicts as the policy chooses, from the adapters that count only for
  tenants beyond their budgets first (their excess is what the budget gives up first).
- A tenant's requests that wait for their budget come after other tenants' waiting requests for
  `yield_s` seconds, then take their turn in arrival order (`defers`): nothing waits behind others
  for ever.

The API, as an engine uses it (tiers are "gpu", counted in slots, and "cpu", counted in bytes):
- `TenantBudgets(gpu_slots, cpu_bytes, {tenant: Budget(gpu_slots, cpu_bytes)}, gpu_share,
  cpu_share)`: the server's budgets; a budget beyond the capacity raises ValueError naming the
  field. `limit(tenant, tier)` is a tenant's budget (None: no limit); `limits_anyone` is False
  when no budget can bind, and the caller may skip the counting.
- `charged(users, last)`: the tenants one resident adapter counts for, from its holders
  (tenant -> requests holding it) and the tenant that used it last.
- `usage(pairs)`: per-tenant usage from `(charged tenants, amount)` pairs over what is resident
  in a tier (amount 1 per slot, or the copy's bytes).
- `victims(tier, tenant, used, need, candidates)`: of the evictable `(key, charged tenants)`
  candidates, the keys `tenant` may displace to take `need` more (1 slot, or the bytes of the
  copy it brings); an empty list means it waits, unless there is free capacity that no other
  tenant's request waits for. The caller's policy chooses among them (pins and in-use adapters
  are never candidates).
- `may_take(tier, tenant, used, need, has_free, candidates)`: whether a placement (or a load
  into host memory) may start now.
- `defers(waited_s)`: whether a request waiting for its budget since `waited_s` ago still lets
  other tenants' waiting requests go first.
- `report(used)`: per tenant and tier, usage against budget, for display.
- `tenant_rows(budgets, used, waits)`: the `tenants` block of `/admin/state` (and the per-tenant
  gauges), from an engine's per-tier counts and bytes: one shape on every engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")
TIERS = ("gpu", "cpu")


@dataclass(frozen=True)
class Budget:
    """One tenant's limits: device slots and host bytes; None is no limit of its own (the server
    default)."""

    gpu_slots: int | None = None
    cpu_bytes: int | None = None

    def __post_init__(self):
        for name, value in (("gpu_slots", self.gpu_slots), ("cpu_bytes", self.cpu_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, not {value}")

    def of(self, tier: str) -> int | None:
        return self.gpu_slots if tier == "gpu" else self.cpu_bytes


def charged(users: Mapping[str, int], last: str) -> frozenset[str]:
    """The tenants a resident adapter counts for: those whose requests hold it now (`users`: tenant
    -> requests), else the one whose request used it last."""
    holding = frozenset(t for t, n in users.items() if n > 0)
    return holding or frozenset((last,))


def usage(resident: Iterable[tuple[frozenset[str], int]]) -> dict[str, int]:
    """Per tenant, the sum of `amount` (1 for a slot, bytes for a host copy) over the resident
    adapters it is charged for."""
    used: dict[str, int] = {}
    for tenants, amount in resident:
        for t in tenants:
            used[t] = used.get(t, 0) + amount
    return used


@dataclass(frozen=True)
class TenantBudgets:
    """The budgets of one server: per tenant, and a default share of the capacity for tenants
    without their own.

    `capacity` is the tier's size (slots, host bytes); `gpu_share` / `cpu_share` are fractions of
    it, 1.0 meaning no limit. A tenant's own budget overrides the share in the tier it sets."""

    gpu_slots: int
    cpu_bytes: int
    tenants: Mapping[str, Budget] = field(default_factory=dict)
    gpu_share: float = 1.0
    cpu_share: float = 1.0
    yield_s: float = 5.0
    """How long a request waiting for its tenant's budget lets other tenants' waiting requests go
    first."""

    def __post_init__(self):
        for name, share in (
            ("tenant_gpu_share", self.gpu_share),
            ("tenant_cpu_share", self.cpu_share),
        ):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], not {share}")
        for tenant, budget in self.tenants.items():
            self.check(tenant, budget)

    def check(self, tenant: str, budget: Budget) -> None:
        """Refuse a budget beyond this server's capacity, naming the field."""
        if budget.gpu_slots is not None and budget.gpu_slots > self.gpu_slots:
            raise ValueError(
                f"max_gpu_slots of tenant {tenant!r} is {budget.gpu_slots}, more than the "
                f"{self.gpu_slots} slots of this server"
            )
        if budget.cpu_bytes is not None and budget.cpu_bytes > self.cpu_bytes:
            raise ValueError(
                f"max_cpu_bytes of tenant {tenant!r} is {budget.cpu_bytes}, more than the "
                f"{self.cpu_bytes} bytes of host memory of this server"
            )

    def limit(self, tenant: str, tier: str) -> int | None:
        """The tenant's budget in `tier` (slots or bytes); None: no limit."""
        own = self.tenants.get(tenant)
        if own is not None and own.of(tier) is not None:
            return own.of(tier)
        share, capacity = (
            (self.gpu_share, self.gpu_slots) if tier == "gpu" else (self.cpu_share, self.cpu_bytes)
        )
        return None if share >= 1.0 else int(share * capacity)

    @property
    def limits_anyone(self) -> bool:
        """Whether any budget can bind (the callers skip the counting otherwise)."""
        return (
            self.gpu_share < 1.0
            or self.cpu_share < 1.0
            or any(
                (b.gpu_slots is not None and b.gpu_slots < self.gpu_slots)
                or (b.cpu_bytes is not None and b.cpu_bytes < self.cpu_bytes)
                for b in self.tenants.values()
            )
        )

    def is_over(self, tenant: str, tier: str, used: Mapping[str, int], need: int) -> bool:
        """Whether taking `need` more (1 slot, a copy's bytes) puts the tenant beyond its budget."""
        limit = self.limit(tenant, tier)
        return limit is not None and used.get(tenant, 0) + need > limit

    def victims(
        self,
        tier: str,
        tenant: str,
        used: Mapping[str, int],
        need: int,
        candidates: Sequence[tuple[K, frozenset[str]]],
    ) -> list[K]:
        """Of the evictable `candidates` (key, charged tenants), those `tenant` may displace to take
        `need` more in `tier`, for the policy to choose from. Beyond its budget: only those that
        count for it alone. Within: those that count only for tenants beyond their budgets when
        there are any, else all."""
        if self.is_over(tenant, tier, used, need):
            return [k for k, ts in candidates if ts == {tenant}]
        excess = [
            k for k, ts in candidates if ts and all(self.is_over(t, tier, used, 0) for t in ts)
        ]
        return excess or [k for k, _ in candidates]

    def may_take(
        self,
        tier: str,
        tenant: str,
        used: Mapping[str, int],
        need: int,
        has_free: bool,
        candidates: Sequence[tuple[K, frozenset[str]]],
    ) -> bool:
        """Whether `tenant` can get `need` more now: from free capacity, or its own room to make."""
        return (
            has_free
            or not self.is_over(tenant, tier, used, need)
            or bool(self.victims(tier, tenant, used, need, candidates))
        )

    def yields_slot(
        self,
        tenant: str,
        used: Mapping[str, int],
        others: Iterable[str],
        waited_s: float | None,
    ) -> bool:
        """Whether a request of `tenant` that needs a free slot leaves it to the waiting requests of
        `others` (tenants): it is beyond its gpu budget, one of them is not, and it has not yet
        deferred for `yield_s` (`waited_s`: since it first did; None: it has not). Free capacity
        is anyone's only while no one else wants it, and nothing starves."""
        if not self.limits_anyone or not self.is_over(tenant, "gpu", used, 1):
            return False
        if waited_s is not None and not self.defers(waited_s):
            return False
        return any(t != tenant and not self.is_over(t, "gpu", used, 1) for t in others)

    def defers(self, waited_s: float) -> bool:
        """Whether a request that has waited `waited_s` for its tenant's budget still lets others go
        first."""
        return waited_s < self.yield_s

    def report(self, used: Mapping[str, Mapping[str, int]]) -> dict[str, dict]:
        """Per tenant (those with a budget or usage): {tier: {"used", "budget"}}, budget None for
        none."""
        names = sorted(set(self.tenants) | {t for tier in TIERS for t in used.get(tier, {})})
        return {
            t: {
                tier: {"used": used.get(tier, {}).get(t, 0), "budget": self.limit(t, tier)}
                for tier in TIERS
            }
            for t in names
        }


def tenant_rows(
    budgets: TenantBudgets,
    used: Mapping[str, Mapping[str, Mapping[str, int]]],
    waits: Mapping[str, int],
) -> dict[str, dict]:
    """Per tenant (with a budget, usage or budget waits): its slots and host bytes against its
    budget, and its budget waits. `used`: per tier (gpu, cpu), per tenant, {"count", "bytes"} of
    what is charged to it there."""
    gpu, cpu = used.get("gpu", {}), used.get("cpu", {})
    report = budgets.report(
        {
            "gpu": {t: r["count"] for t, r in gpu.items()},
            "cpu": {t: r["bytes"] for t, r in cpu.items()},
        }
    )
    for t in waits:
        report.setdefault(
            t, {tier: {"used": 0, "budget": budgets.limit(t, tier)} for tier in TIERS}
        )
    for t, row in report.items():
        row["gpu"] = {
            "slots": row["gpu"]["used"],
            "max_slots": row["gpu"]["budget"],
            "bytes": gpu.get(t, {}).get("bytes", 0),
        }
        row["cpu"] = {
            "bytes": row["cpu"]["used"],
            "max_bytes": row["cpu"]["budget"],
            "count": cpu.get(t, {}).get("count", 0),
        }
        row["budget_waits"] = waits.get(t, 0)
    return report
