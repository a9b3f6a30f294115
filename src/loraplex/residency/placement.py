"""Placement: which adapters should be where, decided over plain data.

A mechanism (the native cache's slots and host copies) describes what it holds in a `Snapshot` and
asks; placement answers with decisions (`Load`, `Evict`, `Activate`, `Wait`) that the mechanism
carries out in order. Placement never moves bytes, never calls into a mechanism and never changes
its input; what it keeps between calls (`Placement`'s memos) is only what it derived from earlier
snapshots, kept while the inputs it came from are the same.

It owns, for a slot pool with host copies (the native cache, the simulator's workers): the warm
sets' use (the sets themselves are `warm.py`'s, which the vLLM residency uses too), the victim
choice (through the policy objects of `loraplex.residency.policy`), pins, the tenant budgets (the
rules of `loraplex.residency.budgets`, applied here), the room rule for waiting requests' loads,
and restoring pinned and gpu-warm adapters to slots.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from typing import NamedTuple, Protocol

from loraplex.residency.budgets import TenantBudgets, usage
from loraplex.residency.decisions import Activate, Decision, Evict, Load, Wait
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import Candidate, DemandTracker
from loraplex.residency.warm import cpu_warm_set, gpu_warm_set

__all__ = ["Activate", "Decision", "Evict", "Load", "Placement", "Snapshot", "Wait"]

WANTED_FOR_S = 2.0
"""A waiting request asks again every step; older asks belong to requests that went away."""


class Adapter(Protocol):
    """One adapter as placement reads it (the native cache's `Entry`)."""

    ref: AdapterRef
    refcount: int  # requests in flight
    last_access: float
    loaded_at: float  # its last activation into a slot
    nbytes: int
    pinned: str | None  # "gpu" or "cpu"
    restored: bool  # put back in its slot by placement, not asked for since
    last_tenant: str
    in_host_since: float  # when its host copy last landed (the native cache's)

    @property
    def charged(self) -> frozenset[str]: ...


class Snapshot(NamedTuple):
    """What placement reads, as of one moment: the mechanism's own tables, read, never changed."""

    # where each adapter is
    entries: Mapping[AdapterKey, Adapter]
    slots: Sequence[AdapterKey | None]  # per device slot, its adapter or None
    host: Collection[AdapterKey]  # the host copies, in the order they came
    host_bytes: int
    loading: Collection[AdapterKey]
    disk_has: Callable[[str], bool] | None  # whether the disk tier holds a digest (a read)
    # the waiting requests
    wanted: Mapping[AdapterKey, float]  # key -> when a waiting request last asked for it
    waiting_since: Mapping[AdapterKey, float]  # key -> when its waiting requests first asked
    budget_waiting: Mapping[AdapterKey, tuple[str, float]]  # key -> (tenant, since)
    num_waiting: Mapping[AdapterKey, int]  # requests waiting for admission, per adapter
    gpu_pins: Set[AdapterKey]
    cpu_pins: Set[AdapterKey]
    # demand and costs
    demand: DemandTracker  # requests per adapter
    activations: DemandTracker  # slot activations per adapter
    slot_loads: DemandTracker  # one key, "gpu": the activations that requests asked for
    seconds_per_byte: Mapping[str, float]  # measured per load stage (download, disk, h2d)
    # capacities and rules
    cpu_bytes: int
    max_cpu_loras: int | None
    max_gpu_warm: int
    policy: object
    budgets: TenantBudgets
    # move when the host copies, loads, cpu pins or asks change, and when an adapter's bytes do
    copies_version: int
    nbytes_version: int


def gpu_pin_refusal(key: AdapterKey, num_pinned: int, num_slots: int) -> str | None:
    """Why `key` cannot be pinned to gpu beside `num_pinned` other gpu pins, or None: it can. The
    rule of both engines: one slot stays free for the other adapters."""
    if num_pinned + 1 <= num_slots - 1:
        return None
    return (
        f"cannot pin {key} to gpu: {num_pinned} of {num_slots} slots are pinned and one must "
        "stay free for other adapters"
    )


class Placement:
    """The placement rules of one cache, with what they keep between calls."""

    def __init__(self):
        self.warm_memo: dict[str, tuple[tuple, set[AdapterKey]]] = {}  # tier -> (inputs, keys)
        self._copies_memo: tuple[tuple[int, int], float, tuple[set, int, int]] | None = None

    # -- requests and operator calls -------------------------------------------------------------
    def admit(self, s: Snapshot, key: AdapterKey, tenant: str, now: float) -> list[Decision]:
        """What a waiting request of `tenant` needs for `key`, which is not in a slot: its host copy
        activated, a load started, or nothing yet (it waits)."""
        if key in s.host:
            return [] if self.yields(s, key, now) else self.activate(s, key, now, tenant)
        if key in s.loading or not self.room_for(s, key, now):
            return []
        if self.host_budget_allows(s, key, tenant):
            return [Load(key, tenant)]
        return [Wait(key, "budget", tenant)]

    def activate(
        self, s: Snapshot, key: AdapterKey, now: float, tenant: str | None
    ) -> list[Decision]:
        """Put the host copy in a slot: a free one, else one the policy frees. `tenant`: the tenant
        whose request asks, held to its budget (None: an operator's pin or prewarm, placed as
        asked). Empty: no slot can be had."""
        if None not in s.slots:
            return self._evict_for(s, key, now, tenant)
        if tenant is not None and self._budget_yields_free_slot(s, key, tenant, now):
            return [Wait(key, "budget", tenant)]
        return [Activate(key, s.slots.index(None))]

    def _evict_for(
        self, s: Snapshot, incoming: AdapterKey, now: float, tenant: str | None
    ) -> list[Decision]:
        entries, policy = s.entries, s.policy
        evictable = [
            k
            for k in s.slots
            if k is not None and (e := entries[k]).refcount == 0 and e.pinned != "gpu"
        ]
        if getattr(policy, "spares_waiting", False):  # its request is about to be admitted
            evictable = [k for k in evictable if k not in s.num_waiting]
        if tenant is not None and self.waits_for_spare_slot(s, incoming, now):
            warm = self.gpu_warm(s, now)
            evictable = [k for k in evictable if k not in warm]
        if not evictable:
            return []  # every slot in use, pinned or spared (with many waiting, most calls)
        rounds = [evictable]
        if tenant is not None and s.budgets.limits_anyone:
            allowed = self._budget_victims(s, tenant, evictable)
            if not allowed:
                return [Wait(incoming, "budget", tenant)]
            # Within its budget, the excess of tenants beyond theirs goes first; the policy's
            # protections may refuse all of it, and then any adapter may go, as without budgets.
            partial = len(allowed) < len(evictable) and not self._over_budget(s, tenant, "gpu")
            rounds = [allowed, evictable] if partial else [allowed]
        victim = None
        for keys in rounds:
            candidates = self.slot_candidates(s, [*keys, incoming], now)
            victim = policy.choose_victim(candidates[:-1], now, candidates[-1])
            if victim is not None:
                break
        if victim is None:
            return []
        return [Evict(victim, "gpu"), Activate(incoming, s.slots.index(victim))]

    def waits_for_spare_slot(self, s: Snapshot, key: AdapterKey, now: float) -> bool:
        """Whether a request for `key`, outside the gpu warm set, leaves the gpu-warm adapters'
        slots alone and waits for one of the others (a policy with `spare_slot_wait_s`): while the
        gpu warm set and the gpu pins leave slots to spare, a burst of one-off adapters cycles
        through those slots and the hot set stays whole. Each spare slot frees when its request
        ends, and the waiting requests take them in the order they wait; a request that has waited
        `spare_slot_wait_s` for a slot may take a gpu-warm adapter's slot like any other, so
        one-offs behind long requests do not wait longer than that. The wait counts from when its
        host copy was ready: a slow download is not a wait for a slot."""
        limit = getattr(s.policy, "spare_slot_wait_s", 0.0)
        since = max(s.waiting_since.get(key, now), s.entries[key].in_host_since)
        if now - since >= limit:
            return False
        warm = self.gpu_warm(s, now)
        return key not in warm and len(warm | s.gpu_pins) < len(s.slots)

    def pin_refusal(self, s: Snapshot, key: AdapterKey, tier: str) -> str | None:
        """Why `key` cannot be pinned to `tier` (gpu or cpu), or None: it can."""
        pins = s.gpu_pins if tier == "gpu" else s.cpu_pins
        pinned = [s.entries[k] for k in pins if k != key]
        if tier == "gpu":
            return gpu_pin_refusal(key, len(pinned), len(s.slots))
        nbytes = s.entries[key].nbytes  # 0 if never loaded
        if tier == "cpu" and sum(e.nbytes for e in pinned) + nbytes > s.cpu_bytes:
            return f"cannot pin {key} to cpu: pinned adapters would exceed cpu_cache_bytes"
        if tier == "cpu" and s.max_cpu_loras is not None and len(pinned) + 1 > s.max_cpu_loras - 1:
            return (
                f"cannot pin {key} to cpu: {len(pinned)} of max_cpu_loras {s.max_cpu_loras} are "
                "pinned and one must stay free for loads"
            )
        return None

    def cpu_pins_fit(self, s: Snapshot) -> bool:
        """Whether the cpu-pinned adapters' bytes fit host memory (a pin made before an adapter's
        bytes were known may not)."""
        return sum(s.entries[k].nbytes for k in s.cpu_pins) <= s.cpu_bytes

    # -- host memory -----------------------------------------------------------------------------
    def shrink_host(self, s: Snapshot, keep: AdapterKey, now: float) -> list[Evict]:
        """The host copies to drop, in order, until host memory is within its capacity, after the
        copy of `keep` landed."""
        policy, entries = s.policy, s.entries
        host, host_bytes, out = list(s.host), s.host_bytes, []
        candidates, left = [], 0
        by_use = getattr(policy, "weighs_host_copies_by_use", False)
        # A policy may give its picks in order (`victims`): the same as asking choose_victim again
        # after each.
        in_order, victims = getattr(policy, "victims", None), None
        while host_bytes > s.cpu_bytes or (
            s.max_cpu_loras is not None and len(host) > s.max_cpu_loras
        ):
            if not left:
                keys = [k for k in host if k != keep and entries[k].pinned != "cpu"]
                if s.budgets.limits_anyone and keep in entries:
                    keys = self._host_budget_victims(s, keep, keys, host)
                # A host copy a waiting request asked for goes last: dropping it means a new load.
                keys = [k for k in keys if k not in s.wanted] or keys
                if not by_use:  # copies of adapters in a slot go last: a slot eviction needs them
                    keys = [k for k in keys if k not in s.slots] or keys
                candidates = self.host_candidates(s, keys, now, by_use)
                left = len(candidates)
                victims = in_order(candidates, now) if in_order is not None else None
            if victims is not None:  # the picks come from the candidates, one each
                victim, left = next(victims, None), left - 1
            else:
                victim = policy.choose_victim(candidates, now)
                candidates = [c for c in candidates if c.key is not victim]
                left = len(candidates)
            if victim is None:
                break
            host.remove(victim)
            host_bytes -= entries[victim].nbytes
            out.append(Evict(victim, "cpu"))
        return out

    def room_for(self, s: Snapshot, key: AdapterKey, now: float) -> bool:
        """Whether a waiting request's load of `key` can land without pushing out the host copy
        of an adapter that another waiting request asked for.

        When the waiting requests' adapters do not all fit in host memory, each load would push
        out another's copy before its request got a slot, and that one would load again, over and
        over (thrash: tens of loads per request with one slot and many waiting); instead such a
        request waits until earlier ones have taken their slots. The scheduler asks in the order
        its requests wait, so the first ones load first. With no other waiting request's copy
        held, a load always may (there is always a first)."""
        held, count, nbytes = self._wanted_copies(s, now)
        if not held or len(held) == 1 and key in held:
            return True
        entries = s.entries
        if key in held and key not in s.cpu_pins:  # its own copy is not another's
            count, nbytes = count - 1, nbytes - entries[key].nbytes
        if s.max_cpu_loras is not None and count + 1 > s.max_cpu_loras:
            return False
        return nbytes + entries[key].nbytes <= s.cpu_bytes

    def _wanted_copies(self, s: Snapshot, now: float) -> tuple[set[AdapterKey], int, int]:
        """The host copies and loads that waiting requests asked for; their count and bytes with the
        cpu pins' (never dropped either). `room_for` is asked for each waiting request whose adapter
        is not in host memory, at every step, so this is kept while nothing it depends on changes:
        the copies, loads, pins and asks (versions), and time only by the oldest ask leaving the
        window (the clock only moves forward)."""
        memo, versions = self._copies_memo, (s.copies_version, s.nbytes_version)
        if memo is not None and memo[0] == versions and now - memo[1] <= WANTED_FOR_S:
            return memo[2]
        wanted, entries = s.wanted, s.entries
        held = {
            k
            for k in itertools.chain(s.host, s.loading)
            if now - wanted.get(k, -math.inf) <= WANTED_FOR_S and k in entries
        }
        both = held | s.cpu_pins
        value = (held, len(both), sum(entries[k].nbytes for k in both))
        # later asks only keep the others in longer
        oldest = min((wanted[k] for k in held), default=math.inf)
        self._copies_memo = (versions, oldest, value)
        return value

    # -- restoring slots -------------------------------------------------------------------------
    def restore_pinned(self, s: Snapshot, now: float) -> list[Decision]:
        """A gpu-pinned adapter that found every slot in use (when it was pinned, or when its load
        landed) takes a slot once one can be had, unless requests wait for one (they come first).
        One adapter's decisions per call; empty: none now."""
        if any(now - asked <= WANTED_FOR_S for asked in s.wanted.values()):
            return []
        for key in sorted(s.gpu_pins - set(s.slots), key=str):
            if key in s.host:
                return self.activate(s, key, now, None)
        return []

    def restore_warm(self, s: Snapshot, now: float) -> list[Decision]:
        """Put a gpu-warm adapter that a one-off pushed out back into a slot once the one-off is
        done, so that its next request finds it on the device (a host-to-device copy, off the
        request's path). One adapter's decisions per call; empty: none now.

        Only an adapter expected back before the slots turn over is restored: one whose
        short-window request count, times the number of slots, is at least the count of slot loads
        over the same window. One expected later would most likely be pushed out again before its
        next request, and its restore would be a copy for nothing; it is activated when it is asked
        for instead. Requests waiting for a slot (any ask in `wanted`) come first."""
        if s.wanted:
            return []
        warm = self.gpu_warm(s, now)
        out = warm - set(s.slots)
        if not out:
            return []  # the usual case: every gpu-warm adapter is in a slot
        demand, entries = s.demand, s.entries
        turnover = s.slot_loads.short("gpu", now) / len(s.slots)
        # the most demanded first; equal demands by key, so the order does not depend on hashing
        for key in sorted(
            out, key=lambda k: (-demand.short(k, now), k.name, k.revision, k.adapter_digest)
        ):
            if key not in s.host:
                continue
            if demand.short(key, now) < turnover:
                return []
            holders = [
                k
                for k in s.slots
                if k is not None
                and k not in warm
                and entries[k].refcount == 0
                and entries[k].pinned != "gpu"
                and k not in s.loading
                and k not in s.num_waiting
            ]
            full = None not in s.slots
            if full and holders and s.budgets.limits_anyone:
                holders = self._budget_victims(s, entries[key].last_tenant, holders)
            if not full:
                return [Activate(key, s.slots.index(None), restored=True)]
            if not holders:
                return []
            victim = min(holders, key=lambda k: demand.short(k, now))
            if demand.short(victim, now) >= demand.short(key, now):
                return []
            return [Evict(victim, "gpu"), Activate(key, s.slots.index(victim), restored=True)]
        return []

    def yields(self, s: Snapshot, key: AdapterKey, now: float) -> bool:
        """Whether `key` leaves the slot it could take to a gpu-warm adapter whose request waits too
        (a policy with `yields_for_s`): when one slot frees for several waiting requests, a
        frequently used adapter gets it before a one-off that happened to arrive first; the one-off
        takes the next. A request yields only during its first `yields_for_s` of waiting, so that
        under sustained load the gpu warm set cannot starve the others."""
        limit = getattr(s.policy, "yields_for_s", 0.0)
        if now - s.waiting_since.get(key, now) >= limit:
            return False  # none, or it has waited long enough: it takes its turn
        wanted, slots = s.wanted, set(s.slots)
        waiting = [  # from the host copies (tens), not the asks (hundreds with many waiting)
            k
            for k in s.host
            if k != key and now - wanted.get(k, -math.inf) <= WANTED_FOR_S and k not in slots
        ]
        if not waiting:
            return False
        warm = self.gpu_warm(s, now)
        return key not in warm and any(k in warm for k in waiting)

    # -- the warm sets ---------------------------------------------------------------------------
    def gpu_warm(self, s: Snapshot, now: float) -> set[AdapterKey]:
        """The gpu warm set: the adapters with the most short-window demand, up to the cap. The set
        is kept until the counts or the time change, and shared: callers must not change it."""
        gaps = getattr(s.policy, "overdue_gaps", None)
        inputs = (now, s.demand, s.demand.version, s.max_gpu_warm, gaps)
        memo = self.warm_memo.get("gpu")
        if memo is not None and memo[0] == inputs:
            return memo[1]
        chosen = set(gpu_warm_set(s.demand, now, s.max_gpu_warm, gaps))
        self.warm_memo["gpu"] = (inputs, chosen)
        return chosen

    def cpu_warm(self, s: Snapshot, now: float) -> set[AdapterKey]:
        """The cpu warm set: adapters with demand over the last hour, up to half the cpu budget
        (kept and shared as the gpu warm set)."""
        gaps = getattr(s.policy, "overdue_gaps", None)
        inputs = (now, s.demand, s.demand.version, s.nbytes_version, s.cpu_bytes, gaps)
        memo = self.warm_memo.get("cpu")
        if memo is not None and memo[0] == inputs:
            return memo[1]
        used, entries, half = 0, s.entries, s.cpu_bytes // 2

        def fits(key: AdapterKey) -> bool:
            nonlocal used
            used += entries[key].nbytes
            return used <= half

        chosen = set(cpu_warm_set(s.demand, now, fits, gaps))
        self.warm_memo["cpu"] = (inputs, chosen)
        return chosen

    # -- candidates, as the policy weighs them ---------------------------------------------------
    def slot_candidates(self, s: Snapshot, keys: list[AdapterKey], now: float) -> list[Candidate]:
        """Adapters as a slot eviction weighs them: losing the slot costs a copy from host memory,
        or a load first when the host copy is gone."""
        warm, rate = self.gpu_warm(s, now), s.seconds_per_byte
        h2d, disk, download = rate.get("h2d", 0.0), rate.get("disk", 0.0), rate.get("download", 0.0)
        # The sums once, in the same order as for each key (so the same floats).
        from_disk, from_remote = h2d + disk + 0.0, h2d + disk + download
        entries, host, has = s.entries, s.host, s.disk_has
        out = []
        for key, demand in zip(keys, self._short_demands(s, keys, now)):
            e = entries[key]
            ref = e.ref
            if key in host:
                per_byte = h2d
            else:
                on_disk = ref.path is not None or (has is not None and has(key.adapter_digest))
                per_byte = from_disk if on_disk else from_remote
            out.append(
                Candidate(
                    key,
                    e.nbytes,
                    e.last_access,
                    e.loaded_at,
                    demand,
                    ref.tenant,
                    ref.priority,
                    per_byte * e.nbytes,
                    key in warm,
                    e.restored,
                )
            )
        return out

    def host_candidates(
        self, s: Snapshot, keys: list[AdapterKey], now: float, by_use: bool
    ) -> list[Candidate]:
        """Host copies as a policy weighs them. `by_use`: by the use each will have. Outside the
        slots, that is the adapter's next request; for an adapter in a slot, only an activation
        after it loses the slot, so such a copy counts its slot activations and its last one, not
        the requests the slot served."""
        warm, rate = self.cpu_warm(s, now), s.seconds_per_byte
        # The gpu warm set is the exception: a gpu-warm adapter pushed out of its slot is restored
        # at once, and that restore is a copy only while its host copy is kept, so that copy counts
        # the adapter's requests.
        in_slots = set(s.slots) - self.gpu_warm(s, now) if by_use else set()
        disk, download = rate.get("disk", 0.0), rate.get("download", 0.0)
        from_disk, from_remote = disk + 0.0, disk + download  # the sums once (the same floats)
        entries, activations, has = s.entries, s.activations, s.disk_has
        out = []
        for key, demand in zip(keys, self._short_demands(s, keys, now)):
            e = entries[key]
            ref = e.ref
            if key in in_slots:
                demand, last = activations.count(key, now), e.loaded_at
            else:
                last = e.last_access
            on_disk = ref.path is not None or (has is not None and has(key.adapter_digest))
            per_byte = from_disk if on_disk else from_remote
            out.append(
                Candidate(
                    key,
                    e.nbytes,
                    last,
                    e.loaded_at,
                    demand,
                    ref.tenant,
                    ref.priority,
                    per_byte * e.nbytes,
                    key in warm,
                )
            )
        return out

    def _short_demands(self, s: Snapshot, keys: list[AdapterKey], now: float) -> list[float]:
        """Each key's short-window count, as a policy weighs it: none for an adapter whose requests
        stopped."""
        gaps = getattr(s.policy, "overdue_gaps", None)
        if gaps is None:
            return s.demand.shorts(keys, now)
        return s.demand.shorts_live(keys, now, gaps)

    # -- tenant budgets (the rule is loraplex.residency.budgets; here, the counts it takes) ----
    def defers(self, s: Snapshot, ref: AdapterRef, now: float) -> bool:
        """Whether a waiting request for `ref` lets other tenants' waiting requests go first: its
        tenant's budget keeps it waiting, for at most the budgets' `yield_s`."""
        waiting = s.budget_waiting.get(ref.key)
        if waiting is None or waiting[0] != ref.tenant:
            return False
        return s.budgets.defers(now - waiting[1])

    def _slot_usage(self, s: Snapshot) -> dict[str, int]:
        entries = s.entries
        return usage((entries[k].charged, 1) for k in s.slots if k is not None)

    def _host_usage(self, s: Snapshot, host: Collection[AdapterKey]) -> dict[str, int]:
        entries = s.entries
        return usage((entries[k].charged, entries[k].nbytes) for k in host)

    def _over_budget(self, s: Snapshot, tenant: str, tier: str) -> bool:
        """Whether one more slot (gpu) or any more bytes (cpu) puts the tenant beyond its budget."""
        used = self._slot_usage(s) if tier == "gpu" else self._host_usage(s, s.host)
        return s.budgets.is_over(tenant, tier, used, 1)

    def _budget_yields_free_slot(
        self, s: Snapshot, key: AdapterKey, tenant: str, now: float
    ) -> bool:
        """Whether a request of `tenant` leaves a free slot to other tenants' requests that wait for
        one (their adapters loading, or in host memory): `TenantBudgets.yields_slot`."""
        if not s.budgets.limits_anyone:
            return False
        waiting = s.budget_waiting.get(key)
        waited_s = now - waiting[1] if waiting is not None else None
        entries, slots = s.entries, s.slots
        others = {
            entries[k].last_tenant
            for k, asked in s.wanted.items()
            if now - asked <= WANTED_FOR_S and k not in slots
        }
        return s.budgets.yields_slot(tenant, self._slot_usage(s), others, waited_s)

    def _budget_victims(self, s: Snapshot, tenant: str, keys: list[AdapterKey]) -> list[AdapterKey]:
        """Of the evictable slot holders `keys`, those the tenant's request may take a slot from."""
        entries = s.entries
        candidates = [(k, entries[k].charged) for k in keys]
        return s.budgets.victims("gpu", tenant, self._slot_usage(s), 1, candidates)

    def host_budget_allows(self, s: Snapshot, key: AdapterKey, tenant: str) -> bool:
        """Whether a load of `key` for `tenant` may start: into free host memory, within its budget,
        or with copies of its own to give up for it (`shrink_host` drops them when it lands)."""
        budgets = s.budgets
        if not budgets.limits_anyone:
            return True
        entries = s.entries
        need = max(entries[key].nbytes, 1)  # 0 before its first load: any more bytes
        has_free = s.host_bytes + need <= s.cpu_bytes and (
            s.max_cpu_loras is None or len(s.host) < s.max_cpu_loras
        )
        own = [(k, entries[k].charged) for k in s.host if entries[k].pinned != "cpu"]
        return budgets.may_take("cpu", tenant, self._host_usage(s, s.host), need, has_free, own)

    def _host_budget_victims(
        self, s: Snapshot, keep: AdapterKey, keys: list[AdapterKey], host: list[AdapterKey]
    ) -> list[AdapterKey]:
        """Of the droppable host copies `keys` (of the copies `host`), those that the landing copy
        `keep` may push out. Its tenant beyond its budget gives up its own, the landing copy
        included when it has no other (its request then waits, and its next load waits for room:
        `host_budget_allows`)."""
        entries = s.entries
        tenant, used = entries[keep].last_tenant, self._host_usage(s, host)
        candidates = [(k, entries[k].charged) for k in keys]
        allowed = s.budgets.victims("cpu", tenant, used, 0, candidates)
        if (
            not allowed
            and s.budgets.is_over(tenant, "cpu", used, 0)
            and keep in host
            and entries[keep].pinned != "cpu"
        ):
            return [keep]
        return allowed
