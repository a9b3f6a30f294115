"""The scheduler's lower-priority queue for budgets: a request that its tenant's budget holds back
lets other tenants' waiting requests take a freed slot first, for a bounded time (the real
scheduler, block manager and cache over a slot pool that only records)."""

from concurrent.futures import Future
from dataclasses import dataclass

from loraplex.engines.native.block_manager import BlockManager
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.scheduler import Scheduler
from loraplex.engines.native.sequence import SamplingParams, Sequence, Status
from loraplex.engines.native.slots import Loaded, native_residency
from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import LRUPolicy


@dataclass(frozen=True)
class Packed:
    nbytes: int


class Pool:
    num_slots = 2

    def set_slot(self, slot, packed) -> float:
        return 0.0

    def clear_slot(self, slot) -> None:
        pass


class Instant:
    def submit(self, fn, ref) -> Future:
        future: Future = Future()
        future.set_result(fn(ref))
        return future


def ref(name: str, tenant: str) -> AdapterRef:
    return AdapterRef(
        AdapterKey("base", name, "1", f"sha256:{name}"), storage_uri=f"mem://{name}", tenant=tenant
    )


def test_a_request_held_back_by_its_budget_gives_a_freed_slot_to_another_tenant_then_its_turn():
    now = [0.0]
    cache = native_residency(
        Pool(),
        lambda files, hashed: None,
        cpu_bytes=2**30,
        policy=LRUPolicy(),
        budgets=TenantBudgets(2, 2**30, {"batch": Budget(gpu_slots=1)}),
        executor=Instant(),
        loader=lambda r: Loaded(Packed(1000), "disk", {}),
        clock=lambda: now[0],
    )
    scheduler = Scheduler(EngineConfig(model_dir="unused"), BlockManager(64, 16), cache)

    def request(name: str, tenant: str) -> Sequence:
        seq = Sequence(
            f"{tenant}-{name}", [1, 2, 3], SamplingParams(max_tokens=4), ref(name, tenant)
        )
        scheduler.add(seq)
        return seq

    def step() -> list[str]:
        cache.backend.poll()  # as the engine loop does between steps: loads land
        prefills = scheduler.schedule().prefills
        for seq in prefills:  # as the engine does once the step ran: the chunk is computed
            seq.num_computed += seq.num_scheduled
        return [s.request_id for s in prefills]

    idle = request("idle", "online")
    assert step() == [] and step() == ["online-idle"]
    scheduler.finish(idle, "stop")
    b0 = request("b0", "batch")
    assert step() == [] and step() == ["batch-b0"]  # batch's one slot
    b1 = request("b1", "batch")
    assert step() == [] and step() == []  # loaded, then held back: its slot is busy
    assert cache.ledger.budget_waits == {"batch": 1}
    o0 = request("o0", "online")  # arrives after b1
    cache.evict(ref("idle", "online").key)  # a slot frees
    assert step() == [] and step() == ["online-o0"]  # online goes first though it came later
    assert b1.status is Status.WAITING

    now[0] += cache.budgets.yield_s  # the bound: b1 no longer gives way, and takes its turn
    scheduler.finish(o0, "stop")
    scheduler.finish(b0, "stop")
    request("o1", "online")
    assert step() == ["batch-b1"]  # in arrival order now, from its own slot; o1's load lands
    assert step() == ["online-o1"]


def test_held_back_past_the_bound_a_request_takes_a_free_slot_though_others_wait():
    now = [0.0]
    cache = native_residency(
        Pool(),
        lambda files, hashed: None,
        cpu_bytes=2**30,
        policy=LRUPolicy(),
        budgets=TenantBudgets(2, 2**30, {"zero": Budget(gpu_slots=0)}),
        executor=Instant(),
        loader=lambda r: Loaded(Packed(1000), "disk", {}),
        clock=lambda: now[0],
    )
    z, o = ref("z", "zero"), ref("o", "online")
    assert cache.acquire(o) is None and cache.acquire(z) is None  # both load
    cache.backend.poll()
    assert cache.acquire(z) is None  # online's request waits for a slot: zero leaves the free ones
    assert cache.ledger.budget_waits == {"zero": 1} and cache.tiers.free_slots() == 2
    now[0] += cache.budgets.yield_s
    cache.backend.mark_wanted(o.key, now[0])  # online's request still waiting (asking at each step)
    assert cache.acquire(z) is not None  # waited the bound: it takes a free slot
