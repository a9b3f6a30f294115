"""Placement for a runtime that keeps its own host cache and device slots and takes adds, removes
and pins from loraplex (the vLLM engine), decided over plain data.

The vLLM residency describes what vLLM holds in a `Held` snapshot and asks; these rules answer with
decisions (`Load`, `Evict`, `Wait`, `Pin`, `Unpin`) or a yes or no, and never move anything. They
own: whether a request may go to vLLM now (`may_run`: a free slot, the gpu warm set's turn, the
tenant budgets' yield), what vLLM keeps pinned (`pins_to_hold`, `pin_changes`), what leaves the
host cache for a load (`make_room`) and what comes back ahead of its requests (`restore`). The warm
sets are `warm.py`'s and the budget rules `budgets.py`'s, as for the native engine's placement.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Set
from typing import NamedTuple, Protocol

from loraplex.residency.budgets import TenantBudgets, usage
from loraplex.residency.decisions import Decision, Evict, Load, Pin, Unpin, Wait
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.placement import gpu_pin_refusal
from loraplex.residency.policy import DemandTracker
from loraplex.residency.warm import (
    BusyShare,
    cpu_warm_set,
    gpu_warm_set,
    host_cache_restore,
    host_cache_victim,
    warm_pins,
)


class Held(Protocol):
    """One adapter as these rules read it (the vLLM engine's `Resident`)."""

    ref: AdapterRef
    refcount: int  # requests holding it, handed to the runtime or waiting
    active: int  # of those, the requests handed to the runtime
    last_access: float
    loaded_at: float
    nbytes: int
    pinned: str | None  # the operator's pin: "gpu" or "cpu"
    last_tenant: str
    in_vllm: bool  # in the runtime's host cache
    adding: bool  # an add sent whose answer has not come
    vllm_pinned: bool  # pinned in the runtime's device slots
    busy: BusyShare
    restorable: bool

    @property
    def charged(self) -> frozenset[str]: ...

    @property
    def in_slot(self) -> bool: ...


class HostSnapshot(NamedTuple):
    """What the rules read, as of one moment: the vLLM residency's tables, read, never changed."""

    entries: Mapping[AdapterKey, Held]
    held: Mapping[AdapterKey, Held]  # in the host cache
    running: Set[AdapterKey]  # with requests handed to the runtime
    runtime_pins: Set[AdapterKey]  # pinned in its device slots
    pins_wanted: Set[AdapterKey]  # the last `pins_to_hold`
    pins: Mapping[AdapterKey, str]  # the operator's: key -> "gpu" or "cpu"
    loading: Collection[AdapterKey]
    slot_waiting: Mapping[str, int]  # per tenant, its requests waiting for a slot
    host_waiting: Set[AdapterKey]  # loads waiting for their tenant's host budget
    num_adding: int  # adds sent whose answer has not come
    demand: DemandTracker
    host_loads: DemandTracker  # one key, "cpu": adds that requests caused
    max_loras: int
    max_cpu_loras: int
    reserved_slots: int  # slots pinned outside these tables (the zero adapter)
    scheduler_counts_pins: bool  # the runtime's scheduler leaves pinned slots out of a batch
    queue_ahead: int  # adapters handed to the runtime beyond its slots (`unpinned_room`)
    policy: object
    budgets: TenantBudgets


def gpu_warm(s: HostSnapshot, now: float) -> list[AdapterKey]:
    """The gpu warm set, as placement's rule gives it for one slot fewer than vLLM has."""
    cap, gaps = max(0, s.max_loras - 1), getattr(s.policy, "overdue_gaps", None)
    return gpu_warm_set(s.demand, now, cap, gaps)


def cpu_warm(s: HostSnapshot, now: float) -> list[AdapterKey]:
    """The cpu warm set, as placement's rule gives it for half of vLLM's host cache."""
    taken, half = 0, s.max_cpu_loras // 2

    def fits(key: AdapterKey) -> bool:
        nonlocal taken
        taken += 1
        return taken <= half

    return cpu_warm_set(s.demand, now, fits, getattr(s.policy, "overdue_gaps", None))


def slot_usage(s: HostSnapshot) -> dict[str, int]:
    return usage((e.charged, 1) for e in s.entries.values() if e.in_slot)


def host_usage(s: HostSnapshot) -> dict[str, int]:
    held = (e for e in s.entries.values() if e.in_vllm or e.adding)
    return usage((e.charged, e.nbytes) for e in held)


def waits(s: HostSnapshot) -> bool:
    """Whether a request or load waits (for a load, a slot, or a place in the host cache)."""
    return bool(s.loading or s.slot_waiting or s.num_adding or s.host_waiting)


# -- whether a request may go to vLLM now --------------------------------------------------------
def has_slot(s: HostSnapshot, entry: Held) -> bool:
    """Whether a request for `entry` may go to vLLM now: the distinct unpinned adapters with
    requests in vLLM stay within `unpinned_room`."""
    if entry.vllm_pinned or entry.active:
        return True
    return busy_unpinned(s) < unpinned_room(s)


def busy_unpinned(s: HostSnapshot) -> int:
    """The distinct unpinned adapters with requests handed to vLLM."""
    return sum(1 for k in s.running if not s.entries[k].vllm_pinned)


def unpinned_room(s: HostSnapshot) -> int:
    """How many distinct unpinned adapters may have requests handed to vLLM at once: the unpinned
    slots, and `queue_ahead` adapters more, whose requests vLLM's scheduler starts in the step a
    slot frees, not a round trip through this process later. The slots alone
    - while a pin waits for the adapters running to fit beside it (`may_pin`), so that they drain;
    - under tenant budgets, which count a tenant's slots by its requests handed to vLLM;
    - while a slot is pinned, when vLLM's scheduler does not count pinned slots (a vLLM without
      loraplex's fix): it then takes up to its slot count of distinct adapters into a batch, and a
      batch with more unpinned adapters than unpinned slots fails in its worker."""
    room = s.max_loras - len(s.runtime_pins)
    pin_waits = bool(s.pins_wanted - s.runtime_pins)
    pinned = s.runtime_pins or s.pins_wanted or s.reserved_slots
    if pin_waits or s.budgets.limits_anyone:
        return room
    if pinned and not s.scheduler_counts_pins:
        return room
    return room + s.queue_ahead


def yields_to_warm(s: HostSnapshot, entry: Held, now: float) -> bool:
    """Whether a request outside the gpu warm set leaves a free slot to an adapter of that set whose
    requests wait for one. The wait is short: an adapter with requests running takes more of them
    without a slot of its own, so the set's adapters wait only to start."""
    if entry.vllm_pinned or entry.active:
        return False
    warm = set(gpu_warm(s, now))
    if entry.ref.key in warm:
        return False
    return any(
        (e := s.entries.get(k)) is not None and e.in_vllm and not e.active and e.refcount
        for k in warm
    )


def yields_slot(s: HostSnapshot, entry: Held, tenant: str, waited_s: float | None) -> bool:
    """Whether a request of `tenant` that needs a slot of its own leaves a free one to other
    tenants' waiting requests (`TenantBudgets.yields_slot`); `waited_s`: how long it has deferred
    (None: it has not)."""
    if entry.in_slot or not s.budgets.limits_anyone:
        return False
    others = [t for t, n in s.slot_waiting.items() if n]
    return s.budgets.yields_slot(tenant, slot_usage(s), others, waited_s)


def spare_room(s: HostSnapshot, now: float) -> bool:
    """Whether vLLM's host cache takes one more adapter without removing one of the gpu warm set:
    a free place, or an idle adapter outside that set."""
    if len(s.held) + s.num_adding < s.max_cpu_loras:
        return True
    warm = set(gpu_warm(s, now))
    return any(
        not (e.refcount or e.pinned or e.vllm_pinned) and k not in warm for k, e in s.held.items()
    )


# -- pins ----------------------------------------------------------------------------------------
def pin_refusal(s: HostSnapshot, key: AdapterKey, tier: str) -> str | None:
    """Why the operator cannot pin `key` to `tier` (gpu or cpu), or None: it can. A pin of either
    tier keeps the adapter in vLLM's host cache, so every pin counts against its places."""
    others = [k for k in s.pins if k != key]
    if tier == "gpu":
        num_pinned = sum(s.pins[k] == "gpu" for k in others)
        if (refusal := gpu_pin_refusal(key, num_pinned, s.max_loras)) is not None:
            return refusal
    if len(others) + 1 > s.max_cpu_loras - 1:
        return f"cannot pin {key}: one of max_cpu_loras {s.max_cpu_loras} must stay free for loads"
    return None


def pins_to_hold(s: HostSnapshot, now: float) -> list[AdapterKey]:
    """What vLLM keeps pinned in its device slots: the operator's gpu pins, then, under a policy
    that keeps the gpu warm set in slots (`score`), the busy adapters of that set when all of them
    fit (`warm_pins`). Together they leave a slot for the other adapters (up to max_loras - 1), and
    with the operator's cpu pins a place in the host cache for loads (up to max_cpu_loras - 1). A
    warm adapter whose tenant is at its gpu budget is pinned only once it runs."""
    cap = max(0, s.max_loras - 1)
    gpu = [k for k, tier in s.pins.items() if tier == "gpu"][:cap]
    if not getattr(s.policy, "restores_gpu_warm", False):
        return gpu
    room = min(cap - len(gpu), s.max_cpu_loras - 1 - len(s.pins))
    gaps = getattr(s.policy, "overdue_gaps", None)
    entries = s.entries
    warm = warm_pins(
        s.demand,
        now,
        room,
        gaps,
        s.held,
        s.runtime_pins,
        lambda k: entries[k].busy.read(now),
        exclude=gpu,
    )
    if warm and s.budgets.limits_anyone:
        used, budgets = slot_usage(s), s.budgets
        warm = [
            k
            for k in warm
            if entries[k].in_slot
            or not any(budgets.is_over(t, "gpu", used, 1) for t in entries[k].charged)
        ]
    return gpu + warm


def pin_changes(s: HostSnapshot, wanted: list[AdapterKey]) -> list[Decision]:
    """What follows from the pins vLLM should hold (`wanted`, in `pins_to_hold`'s order): the idle
    pins no longer wanted go (`Unpin`), then the wanted adapters in vLLM's host cache are pinned
    (`Pin`, carried out when `may_pin` allows it then)."""
    entries, keep = s.entries, set(wanted)
    to_pin = [k for k in wanted if entries[k].in_vllm and not entries[k].vllm_pinned]
    to_unpin = [k for k in s.runtime_pins if k not in keep and not entries[k].refcount]
    return [*(Unpin(k) for k in to_unpin), *(Pin(k) for k in to_pin)]


def may_pin(s: HostSnapshot, entry: Held) -> bool:
    """Whether pinning `entry` leaves a slot unpinned and keeps the distinct unpinned adapters
    running within the unpinned slots (`has_slot`): one running already moves from those to the
    pinned."""
    if len(s.runtime_pins) >= s.max_loras - 1:
        return False  # a pin no longer wanted goes first, once its adapter is idle
    unpinned = busy_unpinned(s) - (1 if entry.active else 0)
    return unpinned <= s.max_loras - len(s.runtime_pins) - 1


# -- the host cache ------------------------------------------------------------------------------
def host_budget_victims(
    s: HostSnapshot, incoming: Held, keys: list[AdapterKey]
) -> list[AdapterKey]:
    """Of the removable adapters `keys`, those that the load of `incoming` may push out of vLLM's
    host cache for the tenant whose load it is: beyond its budget, only its own."""
    pairs = [(k, s.entries[k].charged) for k in keys]
    need = max(incoming.nbytes, 1)
    return s.budgets.victims("cpu", incoming.last_tenant, host_usage(s), need, pairs)


def removable(s: HostSnapshot) -> list[AdapterKey]:
    """The adapters in vLLM's host cache that may leave it: none in use, being added or pinned."""
    return [
        k for k, e in s.held.items() if not (e.refcount or e.adding or e.pinned or e.vllm_pinned)
    ]


def make_room(s: HostSnapshot, incoming: Held, now: float) -> list[Decision]:
    """What makes a place in vLLM's host cache for the load of `incoming`: the policy's victim
    among the removable adapters that the load's tenant may push out (`host_budget_victims`), or
    nothing yet (with `Wait` when its tenant's budget is why)."""
    keys, key = removable(s), incoming.ref.key
    out: list[Decision] = []
    if keys and s.budgets.limits_anyone and not incoming.pinned:
        keys = host_budget_victims(s, incoming, keys)
        if not keys:
            out.append(Wait(key, "budget", incoming.last_tenant))
    pairs = [(k, s.entries[k]) for k in keys]
    gpu = set(gpu_warm(s, now))
    victim = host_cache_victim(s.policy, pairs, (key, incoming), s.demand, gpu, now)
    return [Evict(victim, "cpu")] if victim is not None else out


def restore(s: HostSnapshot, now: float) -> list[Decision]:
    """An adapter of the cpu warm set that left vLLM's host cache, added back ahead of its requests
    while nothing waits, when `host_cache_restore` finds one expected back before the host cache
    turns over: into a free place, or in place of an idle adapter outside both warm sets (within
    the tenants' host budgets). An adapter the operator evicted waits for its next request."""
    if waits(s):
        return []
    entries = s.entries
    warm = [k for k in cpu_warm(s, now) if entries[k].restorable]
    if all(entries[k].in_vllm for k in warm):
        return []  # the usual case
    choice = host_cache_restore(
        s.policy,
        s.demand,
        now,
        warm,
        s.held,
        s.max_cpu_loras,
        [(k, s.held[k]) for k in removable(s)],
        entries,
        set(gpu_warm(s, now)),
        s.host_loads.short("cpu", now),
    )
    if choice is None:
        return []
    key, victim = choice
    chosen = entries[key]
    if s.budgets.limits_anyone:
        if victim is None:
            need = max(chosen.nbytes, 1)
            if s.budgets.is_over(chosen.last_tenant, "cpu", host_usage(s), need):
                return []
        elif not host_budget_victims(s, chosen, [victim]):
            return []
    load = Load(key, chosen.last_tenant)
    return [load] if victim is None else [Evict(victim, "cpu"), load]


def defer_left(s: HostSnapshot, waited_s: float | None) -> float | None:
    """Seconds a request that defers to other tenants' (for `waited_s` so far; None: it does not)
    still lets them go first; None once it does not."""
    if waited_s is None:
        return None
    left = s.budgets.yield_s - waited_s
    return left if left > 0 else None
