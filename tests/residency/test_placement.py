"""Placement over plain data (no torch): it decides and never changes what it reads; the vLLM
engine's host-cache victim comes from the same rule."""

import copy
from concurrent.futures import Future
from dataclasses import dataclass

from loraplex.engines.native.slots import Entry, Loaded, native_residency
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.placement import Activate, Evict
from loraplex.residency.policy import Candidate, DemandTracker, LRUPolicy, ScorePolicy
from loraplex.residency.residency import Residency
from loraplex.residency.warm import (
    BUSY_WINDOW_S,
    BusyShare,
    host_cache_restore,
    host_cache_victim,
    warm_pins,
)

MiB = 2**20


@dataclass(frozen=True)
class Packed:
    nbytes: int


class Pool:
    num_slots = 2

    def set_slot(self, slot, packed) -> float:
        return 0.001

    def clear_slot(self, slot) -> None:
        pass


class Instant:
    def submit(self, fn, ref) -> Future:
        future: Future = Future()
        future.set_result(fn(ref))
        return future


def ref(name: str) -> AdapterRef:
    return AdapterRef(AdapterKey("base", name, "1", f"sha256:{name}"), storage_uri=f"mem://{name}")


def tables(cache: Residency):
    """Everything of the cache that placement reads, copied for comparison."""
    snap = cache.backend.snapshot()
    entries = {k: copy.deepcopy(vars(e)) for k, e in snap.entries.items()}
    return (
        entries,
        list(snap.slots),
        list(snap.host),
        snap.host_bytes,
        list(snap.loading),
        dict(snap.wanted),
        dict(snap.waiting_since),
        dict(snap.num_waiting),
        set(snap.gpu_pins),
        set(snap.cpu_pins),
        snap.demand.version,
    )


def score_cache(pool, now: list[float], loader) -> Residency:
    """A `score` cache with 25 MiB of host memory on the clock `now[0]`, loads landing at once."""
    return native_residency(
        pool,
        lambda files, hashed: None,
        cpu_bytes=25 * MiB,
        policy=ScorePolicy(),
        executor=Instant(),
        clock=lambda: now[0],
        loader=loader,
    )


def test_placement_decides_without_changing_what_it_reads():
    now = [0.0]
    cache = score_cache(Pool(), now, lambda r: Loaded(Packed(10 * MiB), "disk", {"disk": 0.01}))
    a, b, c = ref("a"), ref("b"), ref("c")
    for r in (a, b, a, b):
        now[0] += 1.0
        cache.record_request(r)
        cache.acquire(r)
        cache.backend.poll()
        cache.acquire(r)
    cache.record_request(c)
    cache.acquire(c)  # both slots held: its load starts, its request waits
    while cache.entries[b.key].refcount:
        cache.release(b.key)
    now[0] += 2.0  # past b's minimum residency
    before, placement, snap = tables(cache), cache.backend.placement, cache.backend.snapshot()
    decisions = [
        placement.admit(snap, c.key, "default", now[0]),
        placement.activate(snap, c.key, now[0], None),
        placement.shrink_host(snap, a.key, now[0]),
        placement.restore_warm(snap, now[0]),
        placement.restore_pinned(snap, now[0]),
    ]
    placement.gpu_warm(snap, now[0])
    placement.cpu_warm(snap, now[0])
    placement.room_for(snap, c.key, now[0])
    assert tables(cache) == before
    # c's load runs: its request waits; once its copy is in host memory, b's slot is the one to free
    slot_b = cache.tiers.slot_of(b.key)
    assert decisions[0] == []
    assert decisions[1] == [Evict(b.key, "gpu"), Activate(c.key, slot_b)]
    assert decisions[2:] == [[], [], []]


def test_host_cache_victim_is_the_policys_choice_else_the_least_recently_used():
    demand, now = DemandTracker(), 100.0
    keys = {n: AdapterKey("base", n, "1", f"sha256:{n}") for n in ("old", "new", "in")}
    entries = {n: Entry(AdapterRef(k), last_access=50.0, loaded_at=10.0) for n, k in keys.items()}
    entries["new"].last_access = 99.0
    removable = [(keys[n], entries[n]) for n in ("old", "new")]
    incoming = (keys["in"], entries["in"])
    assert host_cache_victim(LRUPolicy(), removable, incoming, demand, set(), now) == keys["old"]
    # the score policy protects a gpu-warm adapter loaded just now against a colder newcomer;
    # with every candidate protected, a waiting request still gets the least recently used's room
    for t in (99.0, 99.5, 99.9):
        demand.record(keys["new"], t)
    entries["new"].loaded_at = 99.9
    only_new = [(keys["new"], entries["new"])]
    policy, warm = ScorePolicy(), {keys["new"]}
    protected = Candidate(keys["new"], 0, 99.0, 99.9, demand.short(keys["new"], now), warm=True)
    assert policy.choose_victim([protected], now, Candidate(keys["in"], 0, 50.0, 10.0)) is None
    assert host_cache_victim(policy, only_new, incoming, demand, warm, now) == keys["new"]
    assert host_cache_victim(policy, [], incoming, demand, warm, now) is None


def test_warm_pins_are_the_busy_gpu_warm_adapters_all_of_them_or_none():
    demand, now = DemandTracker(), 100.0
    a, b, c, d, e = (AdapterKey("base", n, "1", f"sha256:{n}") for n in "abcde")
    for key, n in ((a, 10), (b, 6), (c, 1), (d, 4), (e, 12)):
        for i in range(n):
            demand.record(key, 90.0 + i * 0.5)
    share = {a: 0.9, b: 0.6, c: 0.9, d: 0.3, e: 0.4}
    held, busy = [c, d, b, e, a], share.__getitem__

    def pins(room, pinned=frozenset(), exclude=(), gaps=None, at=now):
        return warm_pins(demand, at, room, gaps, held, set(pinned), busy, exclude)

    assert pins(2) == [a, b]  # e and d idle more than half the time; c below the warm floor
    assert pins(1) == []  # two busy warm adapters and room for one: none pinned
    assert pins(1, exclude={a}) == [b]
    assert pins(3, pinned={d}) == [a, b, d]  # a pinned one keeps its pin down to a quarter busy
    share[d] = 0.2
    assert pins(3, pinned={d}) == [a, b]
    assert pins(0) == []
    # requests that stopped (20 mean gaps of silence) lose the pin however busy they were
    later = 300.0
    for i in range(4):
        demand.record(a, later - 2 + i * 0.5)
    assert pins(2, gaps=20.0, at=later) == [a]


def test_a_cpu_warm_adapter_comes_back_in_place_of_an_idle_one_when_expected_back_soon():
    demand, now, policy = DemandTracker(), 100.0, ScorePolicy()
    keys = {n: AdapterKey("base", n, "1", f"sha256:{n}") for n in ("warm", "idle", "hot")}
    entries = {n: Entry(AdapterRef(k), last_access=50.0, loaded_at=10.0) for n, k in keys.items()}
    entries = {keys[n]: e for n, e in entries.items()}
    warm, idle, hot = keys["warm"], keys["idle"], keys["hot"]
    for i in range(10):
        demand.record(warm, 90.0 + i)
    demand.record(idle, 95.0)
    removable = [(idle, entries[idle])]

    def restore(held, loads, places=2, gpu_warm=frozenset()):
        return host_cache_restore(
            policy, demand, now, [warm], held, places, removable, entries, set(gpu_warm), loads
        )

    assert restore({idle}, loads=4.0) == (warm, None)  # a free place
    assert restore({idle, hot}, loads=4.0) == (warm, idle)  # in place of the idle one
    assert restore({idle, hot}, loads=40.0) is None  # 10 requests x 2 places < 40 loads
    assert restore({idle, hot}, loads=4.0, gpu_warm={idle}) is None  # never a warm one
    assert restore({warm, idle}, loads=4.0) is None  # already held


def test_busy_share_averages_the_time_with_requests_running():
    share = BusyShare()
    share.set(True, 0.0)
    assert share.read(0.0) == 0.0
    assert 0.63 < share.read(BUSY_WINDOW_S) < 0.64  # 1 - 1/e after one window busy
    share.set(False, BUSY_WINDOW_S)
    assert 0.23 < share.read(2 * BUSY_WINDOW_S) < 0.24  # and it decays while idle


def test_a_one_off_waits_for_a_spare_slot_counted_from_when_its_host_copy_was_ready():
    """a and b are gpu-warm and idle in their slots; d, a one-off, runs in the third. c, another
    one-off, waited 3 s for its download: it still leaves a's and b's slots alone for
    `spare_slot_wait_s` after its copy landed, then takes one like any other."""

    class ThreeSlots(Pool):
        num_slots = 3

    now = [0.0]
    downloads = {"c": 3.0}

    def loader(r):
        now[0] += downloads.get(r.key.name, 0.0)  # the clock moves while it downloads
        return Loaded(Packed(MiB), "remote", {"download": 0.01})

    cache = score_cache(ThreeSlots(), now, loader)
    a, b, c, d = ref("a"), ref("b"), ref("c"), ref("d")
    for r in (a, b, a, b, a, b):
        now[0] += 0.5
        cache.record_request(r)
        if cache.acquire(r) is None:
            cache.backend.poll()
            assert cache.acquire(r) is not None
        cache.release(r.key)
    cache.record_request(d)
    cache.acquire(d)
    cache.backend.poll()
    assert cache.acquire(d) is not None  # d holds the third slot
    asked = now[0]
    cache.record_request(c)
    cache.acquire(c)  # starts c's download, which ends 3 s later
    cache.backend.poll()
    assert cache.entries[c.key].in_host_since == asked + 3.0
    placement, limit = cache.backend.placement, ScorePolicy().spare_slot_wait_s
    now[0] = asked + 3.0 + limit / 2
    snap = cache.backend.snapshot()
    assert placement.gpu_warm(snap, now[0]) == {a.key, b.key}
    assert placement.activate(snap, c.key, now[0], "default") == []
    now[0] = asked + 3.0 + limit
    decisions = placement.activate(cache.backend.snapshot(), c.key, now[0], "default")
    assert [type(x).__name__ for x in decisions] == ["Evict", "Activate"]
    assert decisions[0].key in (a.key, b.key)
