"""The vLLM engine's placement rules (`residency/host_cache.py`) over the tables of a real
`VllmTables` and its ledger: the decisions they give, and the gpu pins' rule they share with the
native engine's placement."""

from __future__ import annotations

from loraplex.residency import host_cache
from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.decisions import Evict, Load, Pin, Unpin, Wait
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Ledger
from loraplex.residency.placement import gpu_pin_refusal
from loraplex.residency.policy import LRUPolicy, ScorePolicy
from loraplex.residency.runtime import HOST_BYTES_UNBOUNDED, VllmTables


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tables(budgets: dict[str, Budget] | None = None, policy=None, max_loras=2, max_cpu_loras=3):
    clock = Clock()
    ledger = Ledger(
        policy=policy or LRUPolicy(),
        budgets=TenantBudgets(max_loras, HOST_BYTES_UNBOUNDED, budgets or {}),
        clock=clock,
    )
    tables = ledger.tiers = VllmTables(ledger, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    return tables, clock


def _ref(name: str, tenant: str = "alice") -> AdapterRef:
    key = AdapterKey("sha256:base", name, "1", f"sha256:{name}")
    return AdapterRef(key, storage_uri=f"file:///{name}", tenant=tenant)


def _held(tables: VllmTables, name: str, tenant: str = "alice", nbytes: int = 100):
    entry = tables.entry(_ref(name, tenant))
    entry.nbytes = nbytes
    tables.set_in_vllm(entry, True)
    return entry


def test_a_gpu_pin_leaves_one_slot_free_by_the_rule_both_engines_share():
    tables, _ = _tables()
    a, b = _held(tables, "a"), _held(tables, "b")
    assert host_cache.pin_refusal(tables.snapshot(), a.ref.key, "gpu") is None
    tables.ledger.set_pin(a.ref.key, "gpu")
    refusal = host_cache.pin_refusal(tables.snapshot(), b.ref.key, "gpu")
    assert refusal == gpu_pin_refusal(b.ref.key, 1, 2)
    assert refusal is not None and "1 of 2 slots are pinned and one must stay free" in refusal
    # every pin holds a place of the host cache: with 3 places, the third leaves none for loads
    tables.ledger.set_pin(b.ref.key, "cpu")
    c = _held(tables, "c")
    assert "max_cpu_loras 3 must stay free for loads" in host_cache.pin_refusal(
        tables.snapshot(), c.ref.key, "cpu"
    )


def test_make_room_evicts_the_victim_or_waits_for_the_tenants_host_budget():
    tables, clock = _tables()
    old, new = _held(tables, "old", "bob"), _held(tables, "new", "bob")
    old.last_access, new.last_access = 1.0, 50.0
    incoming = tables.entry(_ref("in", "alice"))
    snap = tables.snapshot()
    assert host_cache.make_room(snap, incoming, clock.now) == [Evict(old.ref.key, "cpu")]
    # alice may hold no host bytes: bob's adapters are not hers to push out
    tables, clock = _tables(budgets={"alice": Budget(cpu_bytes=0)})
    _held(tables, "old", "bob"), _held(tables, "new", "bob")
    incoming = tables.entry(_ref("in", "alice"))
    decisions = host_cache.make_room(tables.snapshot(), incoming, clock.now)
    assert decisions == [Wait(incoming.ref.key, "budget", "alice")]


def test_restore_adds_a_cpu_warm_adapter_back_while_nothing_waits():
    tables, clock = _tables()
    _held(tables, "idle")
    warm = tables.entry(_ref("warm"))
    for _ in range(3):
        tables.demand.record(warm.ref.key, clock.now)
    assert host_cache.restore(tables.snapshot(), clock.now) == [Load(warm.ref.key, "alice")]
    tables.host_waiting.add(warm.ref.key)  # a load waits: nothing comes back ahead of requests
    assert host_cache.restore(tables.snapshot(), clock.now) == []


def test_pin_changes_unpin_the_idle_pins_no_longer_held_then_pin_the_wanted():
    tables, clock = _tables(policy=ScorePolicy(), max_loras=4, max_cpu_loras=8)
    gone, kept = _held(tables, "gone"), _held(tables, "kept")
    tables.set_vllm_pinned(gone, True)
    tables.ledger.set_pin(kept.ref.key, "gpu")
    wanted = host_cache.pins_to_hold(tables.snapshot(), clock.now)
    assert wanted == [kept.ref.key]  # the operator's pin; "gone" has no demand to stay warm
    changes = host_cache.pin_changes(tables.snapshot(), wanted)
    assert changes == [Unpin(gone.ref.key), Pin(kept.ref.key)]


def test_a_request_may_go_to_vllm_within_the_unpinned_slots_and_the_queue_ahead():
    tables, _ = _tables(max_loras=2, max_cpu_loras=6)  # queue ahead: min(2, 6 - 2) // 2 = 1
    running = [_held(tables, name) for name in ("r1", "r2", "r3")]
    waiting = _held(tables, "w")
    assert host_cache.unpinned_room(tables.snapshot()) == 3
    for entry in running[:2]:
        entry.active = 1
        tables.running.add(entry.ref.key)
    assert host_cache.has_slot(tables.snapshot(), waiting)
    running[2].active = 1
    tables.running.add(running[2].ref.key)
    assert not host_cache.has_slot(tables.snapshot(), waiting)
    assert host_cache.has_slot(tables.snapshot(), running[0])  # running already: more may join
