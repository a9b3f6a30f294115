"""The vLLM residency's tables: what vLLM holds of the adapters loraplex tracks, who waits, and the
rules over them (any thread, under the ledger's lock): whether a request may go to vLLM now, what to
pin, what may leave vLLM's host cache. The mechanism that calls vLLM is `residency.VllmResidency`;
the records are the shared ledger's (`loraplex.residency.ledger`)."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field

from loraplex.engines.vllm.staging import Staging
from loraplex.residency.budgets import usage
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Entry, Ledger
from loraplex.residency.policy import DemandTracker
from loraplex.residency.warm import BusyShare, cpu_warm_set, gpu_warm_set, warm_pins

WARM_PIN_LOOK_S = 0.5  # how often a request waiting for a slot looks whether a warm pin may go
# vLLM's host cache is sized in adapters (max_cpu_loras), not bytes: no byte capacity bounds a
# tenant's host-bytes budget.
HOST_BYTES_UNBOUNDED = sys.maxsize


def lora_int_id(key: AdapterKey) -> int:
    """vLLM's integer id for a key: from a hash of the whole key (digest included), so another
    revision or other bytes never get the id of weights vLLM already holds. 62 bits: a positive
    int64, never 0."""
    text = "\0".join(
        (
            key.base_model_digest,
            key.name,
            key.revision,
            key.adapter_digest,
            key.runtime_compat_version,
        )
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2 or 1


@dataclass
class Resident(Entry):
    """One adapter as loraplex tracks it on the vLLM engine: the ledger's entry, and what vLLM
    holds of it."""

    lora_id: int = 0
    active: int = (
        0  # of its references, the requests handed to vLLM (others wait for a load or slot)
    )
    in_vllm: bool = False  # added to vLLM's host cache (or its add sent, for a known adapter)
    adding: bool = False  # an add sent to vLLM whose answer has not come: never removed meanwhile
    vllm_pinned: bool = False  # pin_lora'd (or its pin sent): kept in a device slot by vLLM
    busy: BusyShare = field(default_factory=BusyShare)  # recent time with requests in vLLM
    restorable: bool = True  # added back ahead of its requests (False from an operator's evict)
    shape: str | None = None  # what vLLM's add checks of it, as a digest (`vllm_shape`)

    @property
    def in_slot(self) -> bool:
        """Holding one of vLLM's device slots as loraplex counts them: pinned, or running."""
        return self.in_vllm and (self.vllm_pinned or self.active > 0)


class VllmTables:
    """What vLLM holds of the adapters and who waits (the residency's `Tiers`), and the rules the
    residency decides by: whether a request may go to vLLM, what to pin, what the host cache takes.
    The records are the ledger's."""

    def __init__(
        self,
        ledger: Ledger[Resident],
        *,
        max_loras: int,
        max_cpu_loras: int,
        reserved_slots: int = 0,
        scheduler_counts_pins: bool = False,
    ):
        self.ledger = ledger
        self.staging: Staging  # set by the residency, whose backend makes it over `in_use`
        self.entries, self.pins, self.demand = ledger.entries, ledger.pins, ledger.demand
        self.loading, self._lock = ledger.loading, ledger._lock
        self.max_loras = max_loras
        # vLLM's slots pinned outside this table (the zero adapter)
        self.reserved_slots = reserved_slots
        self.max_cpu_loras = max_cpu_loras
        # vLLM's scheduler leaves out of a batch's budget the slots that pinned adapters outside
        # it hold (loraplex's plugin, `patches.py`), so pins hold no request back here
        self.scheduler_counts_pins = scheduler_counts_pins
        # adapters handed to vLLM beyond its slots while none is pinned (`unpinned_room`): up to
        # half the slots, within half the host cache's places beyond the slots (the others take
        # the loads meanwhile)
        self.queue_ahead = min(max_loras, max(0, max_cpu_loras - max_loras)) // 2
        self.slot_waiting: dict[str, int] = {}  # per tenant, its requests waiting for a slot
        self.host_waiting: set[AdapterKey] = set()  # loads waiting for their tenant's host budget
        # Indexes of `entries` that the request path reads instead of a pass over every adapter:
        # those in vLLM's host cache, those with requests handed to vLLM, those pinned in vLLM, and
        # the last `pins_to_hold`.
        self.held: dict[AdapterKey, Resident] = {}
        self.running: set[AdapterKey] = set()
        self.vllm_pins: set[AdapterKey] = set()
        self.pins_wanted: set[AdapterKey] = set()
        self.host_loads = DemandTracker(ranked=False)  # one key, "cpu": adds that requests caused
        self.ids: dict[int, AdapterKey] = {}
        self.num_adding = 0  # adds sent to vLLM whose answer has not come

    # -- what the ledger reads (vLLM's tiers) ------------------------------------------------------
    def in_slot(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.in_slot

    def in_host_memory(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.in_vllm

    def in_slots(self) -> list[AdapterKey]:
        return [k for k, e in self.held.items() if e.in_slot]

    def in_host(self) -> list[AdapterKey]:
        return list(self.held)

    @property
    def num_slots(self) -> int:
        return self.max_loras

    def free_slots(self) -> int:
        return max(0, self.max_loras - len(self.in_slots()))

    def warm_sets(self, now: float) -> tuple[set[AdapterKey], set[AdapterKey]]:
        return set(self.gpu_warm(now)), set(self.cpu_warm(now))

    def adapter_row(self, entry: Resident, row: dict) -> dict:
        return {**row, "lora_int_id": entry.lora_id}

    def host_figures(self) -> dict:
        return {
            "cpu_bytes_used": sum(e.nbytes for e in self.held.values()),
            "cpu_loras_used": len(self.held),
            "cpu_loras_capacity": self.max_cpu_loras,
        }

    def staged(self, key: AdapterKey) -> bool:
        return self.staging.has(key)

    def slot_usage(self) -> dict[str, int]:
        return usage((e.charged, 1) for e in self.entries.values() if e.in_slot)

    def host_usage(self) -> dict[str, int]:
        held = (e for e in self.entries.values() if e.in_vllm or e.adding)
        return usage((e.charged, e.nbytes) for e in held)

    def yields_slot(self, entry: Resident, tenant: str, deferred_at: float | None) -> bool:
        """Whether a request of `tenant` that needs a slot of its own leaves a free one to other
        tenants' waiting requests (`TenantBudgets.yields_slot`)."""
        if entry.in_slot or not self.ledger.budgets.limits_anyone:
            return False
        others = [t for t, n in self.slot_waiting.items() if n]
        waited_s = self.ledger.clock() - deferred_at if deferred_at is not None else None
        with self._lock:
            return self.ledger.budgets.yields_slot(tenant, self.slot_usage(), others, waited_s)

    def defer_left(self, deferred_at: float | None) -> float | None:
        """Seconds a deferring request still lets others go first (None: it does not)."""
        if deferred_at is None:
            return None
        left = self.ledger.budgets.yield_s - (self.ledger.clock() - deferred_at)
        return left if left > 0 else None

    def host_budget_victims(self, incoming: Resident, keys: list[AdapterKey]) -> list[AdapterKey]:
        """Of the removable adapters `keys`, those that the load of `incoming` may push out of
        vLLM's host cache for the tenant whose load it is: beyond its budget, only its own."""
        entries = self.entries
        pairs = [(k, entries[k].charged) for k in keys]
        need = max(incoming.nbytes, 1)
        return self.ledger.budgets.victims(
            "cpu", incoming.last_tenant, self.host_usage(), need, pairs
        )

    def entry(self, ref: AdapterRef) -> Resident:
        entry = self.entries.get(ref.key)
        if entry is None:
            lora_id = lora_int_id(ref.key)
            if (
                self.ids.get(lora_id, ref.key) != ref.key
            ):  # a 62-bit collision: refuse rather than mix weights
                raise AdapterUnavailable(
                    f"{ref.key}: its vLLM id collides with {self.ids[lora_id]}"
                )
            self.ids[lora_id] = ref.key
            entry = self.entries[ref.key] = Resident(ref, lora_id=lora_id)
        return entry

    def busy_unpinned(self) -> int:
        """The distinct unpinned adapters with requests handed to vLLM."""
        return sum(1 for k in self.running if not self.entries[k].vllm_pinned)

    def num_in_vllm(self) -> int:
        return len(self.held)

    def set_in_vllm(self, entry: Resident, held: bool) -> None:
        """`entry` in or out of vLLM's host cache (out of it, not pinned in vLLM either)."""
        with self._lock:
            entry.in_vllm = held
            if held:
                self.held[entry.ref.key] = entry
            else:
                self.set_vllm_pinned(entry, False)
                self.held.pop(entry.ref.key, None)

    def set_vllm_pinned(self, entry: Resident, pinned: bool) -> None:
        entry.vllm_pinned = pinned
        if pinned:
            self.vllm_pins.add(entry.ref.key)
        else:
            self.vllm_pins.discard(entry.ref.key)

    def gpu_warm(self, now: float) -> list[AdapterKey]:
        """The gpu warm set, as placement's rule gives it for one slot fewer than vLLM has."""
        cap, gaps = max(0, self.max_loras - 1), getattr(self.ledger.policy, "overdue_gaps", None)
        return gpu_warm_set(self.demand, now, cap, gaps)

    def cpu_warm(self, now: float) -> list[AdapterKey]:
        """The cpu warm set, as placement's rule gives it for half of vLLM's host cache."""
        taken, half = 0, self.max_cpu_loras // 2

        def fits(key: AdapterKey) -> bool:
            nonlocal taken
            taken += 1
            return taken <= half

        return cpu_warm_set(
            self.demand, now, fits, getattr(self.ledger.policy, "overdue_gaps", None)
        )

    def waits(self) -> bool:
        """Whether a request or load waits (for a load, a slot, or a place in the host cache)."""
        return bool(self.loading or self.slot_waiting or self.num_adding or self.host_waiting)

    def pins_to_hold(self, now: float) -> list[AdapterKey]:
        """What vLLM keeps pinned in its device slots: the operator's gpu pins, then, under a policy
        that keeps the gpu warm set in slots (`score`), the busy adapters of that set when all of
        them fit (`warm_pins`). Together they leave a slot for the other adapters (up to
        max_loras - 1), and with the operator's cpu pins a place in the host cache for loads (up to
        max_cpu_loras - 1). A warm adapter whose tenant is at its gpu budget is pinned only once it
        runs."""
        cap = max(0, self.max_loras - 1)
        gpu = [k for k, tier in self.pins.items() if tier == "gpu"][:cap]
        if not getattr(self.ledger.policy, "restores_gpu_warm", False):
            return gpu
        room = min(cap - len(gpu), self.max_cpu_loras - 1 - len(self.pins))
        gaps = getattr(self.ledger.policy, "overdue_gaps", None)
        entries = self.entries
        warm = warm_pins(
            self.demand,
            now,
            room,
            gaps,
            self.held,
            self.vllm_pins,
            lambda k: entries[k].busy.read(now),
            exclude=gpu,
        )
        if warm and self.ledger.budgets.limits_anyone:
            used, budgets = self.slot_usage(), self.ledger.budgets
            warm = [
                k
                for k in warm
                if self.entries[k].in_slot
                or not any(budgets.is_over(t, "gpu", used, 1) for t in self.entries[k].charged)
            ]
        return gpu + warm

    def may_pin(self, entry: Resident) -> bool:
        """Whether pinning `entry` leaves a slot unpinned and keeps the distinct unpinned adapters
        running within the unpinned slots (`has_slot`): one running already moves from those to
        the pinned."""
        if len(self.vllm_pins) >= self.max_loras - 1:
            return False  # a pin no longer wanted goes first, once its adapter is idle
        unpinned = self.busy_unpinned() - (1 if entry.active else 0)
        return unpinned <= self.max_loras - len(self.vllm_pins) - 1

    def yields_to_warm(self, entry: Resident) -> bool:
        """Whether a request outside the gpu warm set leaves a free slot to an adapter of that set
        whose requests wait for one. The wait is short: an adapter with requests running takes
        more of them without a slot of its own, so the set's adapters wait only to start."""
        if entry.vllm_pinned or entry.active:
            return False
        with self._lock:
            warm = set(self.gpu_warm(self.ledger.clock()))
            if entry.ref.key in warm:
                return False
            return any(
                (e := self.entries.get(k)) is not None and e.in_vllm and not e.active and e.refcount
                for k in warm
            )

    def has_slot(self, entry: Resident) -> bool:
        """Whether a request for `entry` may go to vLLM now: the distinct unpinned adapters with
        requests in vLLM stay within `unpinned_room`."""
        if entry.vllm_pinned or entry.active:
            return True
        with self._lock:
            return self.busy_unpinned() < self.unpinned_room()

    def unpinned_room(self) -> int:
        """How many distinct unpinned adapters may have requests handed to vLLM at once: the
        unpinned slots, and `queue_ahead` adapters more, whose requests vLLM's scheduler starts in
        the step a slot frees, not a round trip through this process later. The slots alone
        - while a pin waits for the adapters running to fit beside it (`may_pin`), so that they
          drain;
        - under tenant budgets, which count a tenant's slots by its requests handed to vLLM;
        - while a slot is pinned, when vLLM's scheduler does not count pinned slots (a vLLM without
          loraplex's fix): it then takes up to its slot count of distinct adapters into a batch,
          and a batch with more unpinned adapters than unpinned slots fails in its worker."""
        room = self.max_loras - len(self.vllm_pins)
        pin_waits = bool(self.pins_wanted - self.vllm_pins)
        pinned = self.vllm_pins or self.pins_wanted or self.reserved_slots
        if pin_waits or self.ledger.budgets.limits_anyone:
            return room
        if pinned and not self.scheduler_counts_pins:
            return room
        return room + self.queue_ahead

    def spare_room(self) -> bool:
        """Whether vLLM's host cache takes one more adapter without removing one of the gpu warm
        set: a free place, or an idle adapter outside that set."""
        with self._lock:
            if self.num_in_vllm() + self.num_adding < self.max_cpu_loras:
                return True
            warm = set(self.gpu_warm(self.ledger.clock()))
            return any(
                not (e.refcount or e.pinned or e.vllm_pinned) and k not in warm
                for k, e in self.held.items()
            )

    def in_use(self, name: str) -> bool:
        """Whether vLLM holds or a load reads the staged copy `name` (keys with the same digest
        share it)."""
        with self._lock:
            return any(self.staging.path(k).name == name for k in (*self.held, *self.loading))
