"""Per-tenant residency budgets: the rule over plain data (loraplex.residency.budgets), and the
cache applying it to slots and host copies (no torch)."""

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from loraplex.engines.native.slots import Loaded, native_residency
from loraplex.residency.budgets import Budget, TenantBudgets, charged, usage
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import LRUPolicy

MiB = 2**20


# -- the rule -------------------------------------------------------------------------------
def test_an_adapter_counts_for_the_tenants_holding_it_else_the_last_user():
    assert charged({"a": 1, "b": 2}, "c") == {"a", "b"}
    assert charged({"a": 0}, "c") == {"c"}
    assert usage([(frozenset({"a", "b"}), 1), (frozenset({"a"}), 1)]) == {"a": 2, "b": 1}


def test_over_its_budget_a_tenant_may_displace_only_what_counts_for_it_alone():
    budgets = TenantBudgets(8, 1000, {"batch": Budget(gpu_slots=2)})
    used = {"batch": 2, "online": 4}
    candidates = [
        ("b1", frozenset({"batch"})),
        ("o1", frozenset({"online"})),
        ("s1", frozenset({"batch", "online"})),
    ]
    assert budgets.victims("gpu", "batch", used, 1, candidates) == ["b1"]
    assert budgets.may_take("gpu", "batch", used, 1, False, candidates[1:]) is False
    assert budgets.may_take("gpu", "batch", used, 1, True, []) is True  # a free slot: anyone's
    # within its budget (no limit), online takes from the tenants beyond theirs first
    assert budgets.victims("gpu", "online", {"batch": 3, "online": 4}, 1, candidates) == ["b1"]
    assert budgets.victims("gpu", "online", used, 1, candidates) == ["b1", "o1", "s1"]


def test_zero_is_served_only_from_free_capacity_and_shares_are_the_default():
    budgets = TenantBudgets(4, 1000, {"zero": Budget(gpu_slots=0)}, gpu_share=0.5, cpu_share=0.25)
    assert budgets.limit("zero", "gpu") == 0 and budgets.limit("zero", "cpu") == 250
    assert budgets.limit("other", "gpu") == 2
    assert budgets.victims("gpu", "zero", {}, 1, [("k", frozenset({"other"}))]) == []
    assert budgets.may_take("gpu", "zero", {}, 1, True, []) is True
    assert TenantBudgets(4, 1000).limits_anyone is False
    assert budgets.defers(0.0) and not budgets.defers(budgets.yield_s)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Budget(gpu_slots=-1), "gpu_slots"),
        (lambda: TenantBudgets(4, 1000, {"t": Budget(gpu_slots=5)}), "max_gpu_slots"),
        (lambda: TenantBudgets(4, 1000, {"t": Budget(cpu_bytes=1001)}), "max_cpu_bytes"),
        (lambda: TenantBudgets(4, 1000, gpu_share=1.5), "tenant_gpu_share"),
    ],
)
def test_bad_budgets_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# -- the cache applying it -------------------------------------------------------------------
@dataclass(frozen=True)
class Packed:
    nbytes: int


class Pool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots

    def set_slot(self, slot, packed) -> float:
        return 0.0

    def clear_slot(self, slot) -> None:
        pass


class Instant:
    def submit(self, fn, ref) -> Future:
        future: Future = Future()
        future.set_result(fn(ref))
        return future


def make_cache(slots: int, cpu_mib: int, budgets: dict[str, Budget]):
    now = [0.0]
    cache = native_residency(
        Pool(slots),
        lambda files, hashed: None,
        cpu_bytes=cpu_mib * MiB,
        policy=LRUPolicy(),
        budgets=TenantBudgets(slots, cpu_mib * MiB, budgets),
        executor=Instant(),
        loader=lambda ref: Loaded(Packed(10 * MiB), "disk", {"disk": 0.01}),
        clock=lambda: now[0],
    )
    return cache, now


def ref(name: str, tenant: str) -> AdapterRef:
    return AdapterRef(
        AdapterKey("base", name, "1", f"sha256:{name}"), storage_uri=f"mem://{name}", tenant=tenant
    )


def serve(cache, now, r, hold: bool = False) -> int | None:
    """A request: loaded if needed, in a slot, released unless `hold`; None when it had to wait."""
    now[0] += 1.0
    slot = cache.acquire(r)
    if slot is None:
        cache.backend.poll()
        slot = cache.acquire(r)
    if slot is not None and not hold:
        cache.release(r.key, r.tenant)
    return slot


def test_a_tenant_at_its_slot_budget_reuses_its_own_slots_and_waits_while_they_are_busy():
    cache, now = make_cache(4, 1000, {"batch": Budget(gpu_slots=1)})
    for i in range(3):
        serve(cache, now, ref(f"o{i}", "online"))
    assert serve(cache, now, ref("b0", "batch"), hold=True) is not None  # a free slot
    # its one slot is busy: it waits, online's stay
    assert serve(cache, now, ref("b1", "batch")) is None
    assert cache.ledger.budget_waits == {"batch": 1}
    assert cache.backend.defers(ref("b1", "batch")) and not cache.backend.defers(
        ref("b1", "online")
    )
    cache.release(ref("b0", "batch").key, "batch")
    assert serve(cache, now, ref("b1", "batch")) is not None  # from its own adapter
    assert {k.name for k in cache.backend.slots} == {"o0", "o1", "o2", "b1"}
    assert cache.budget_state()["batch"]["gpu"] == {"slots": 1, "max_slots": 1, "bytes": 10 * MiB}
    assert cache.backend.budget_waiting == {}


def test_a_shared_adapter_counts_for_each_tenant_using_it():
    cache, now = make_cache(2, 1000, {"batch": Budget(gpu_slots=1)})
    shared = ref("shared", "online")
    serve(cache, now, ref("o0", "online"))
    assert serve(cache, now, shared, hold=True) is not None
    assert (
        serve(
            cache, now, AdapterRef(shared.key, shared.path, shared.storage_uri, "batch"), hold=True
        )
        is not None
    )
    assert cache.entries[shared.key].charged == {"online", "batch"}
    # batch holds its one slot through the shared adapter
    assert serve(cache, now, ref("b0", "batch")) is None
    cache.release(shared.key, "online")
    cache.release(shared.key, "batch")
    assert cache.entries[shared.key].charged == {"batch"}  # the last to use it


def test_a_zero_budget_is_served_only_from_free_slots():
    cache, now = make_cache(2, 1000, {"zero": Budget(gpu_slots=0)})
    assert serve(cache, now, ref("z0", "zero")) is not None  # a free slot
    serve(cache, now, ref("o0", "online"))
    assert serve(cache, now, ref("z1", "zero")) is not None  # its own adapter's slot: its only room
    cache.evict(ref("z1", "zero").key)
    serve(cache, now, ref("o1", "online"))
    assert serve(cache, now, ref("z2", "zero")) is None  # no free slot, none of its own
    assert {k.name for k in cache.backend.slots} == {"o0", "o1"}


def test_over_its_host_budget_a_tenant_drops_its_own_copies_and_never_another_tenants():
    # room for 5 copies, batch 2
    cache, now = make_cache(1, 50, {"batch": Budget(cpu_bytes=20 * MiB)})
    for i in range(3):
        serve(cache, now, ref(f"o{i}", "online"))
    for i in range(4):
        serve(cache, now, ref(f"b{i}", "batch"))
    names = {k.name for k in cache.backend.cpu}
    assert {"o0", "o1", "o2"} <= names  # online's copies stay
    assert len(names) == 5 and cache.budget_state()["batch"]["cpu"]["bytes"] == 20 * MiB
    assert cache.tiers.cpu_bytes_used <= cache.backend.cpu_bytes


def test_a_gpu_pin_is_never_a_victim_of_a_budget():
    cache, now = make_cache(2, 1000, {"batch": Budget(gpu_slots=1)})
    pinned = ref("b0", "batch")
    cache.pin(pinned, "gpu")
    cache.backend.poll()
    assert cache.tiers.slot_of(pinned.key) is not None
    assert serve(cache, now, ref("b1", "batch")) is not None  # a free slot
    serve(cache, now, ref("o0", "online"))  # online, within its budget, takes batch's excess
    assert serve(cache, now, ref("b2", "batch")) is None  # over: only its own, and its pin stays
    assert cache.tiers.slot_of(pinned.key) is not None
