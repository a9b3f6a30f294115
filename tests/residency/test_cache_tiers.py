"""The cache's own decisions over plain data (no torch): restoring gpu-warm adapters, weighing
host copies, measured reload costs."""

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from loraplex.engines.native.slots import Loaded, native_residency
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import ScorePolicy

MiB = 2**20


@dataclass(frozen=True)
class Packed:
    nbytes: int


class Pool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.copies = 0

    def set_slot(self, slot, packed) -> float:
        self.copies += 1
        return packed.nbytes / 10e9  # a 10 GB/s copy

    def clear_slot(self, slot) -> None:
        pass


class Instant:
    """An executor whose loads finish at once: 1 ms of disk read per MiB, plus a download if
    asked."""

    def __init__(self, download: set[str] = frozenset()):
        self.download = download

    def submit(self, fn, ref) -> Future:
        future: Future = Future()
        future.set_result(fn(ref))
        return future


def loader(download: set[str]):
    def load(ref: AdapterRef) -> Loaded:
        nbytes = 100 * MiB
        stages = {"disk": nbytes / 1e9}
        if ref.key.name in download:
            stages["download"] = nbytes / 1e8
        return Loaded(Packed(nbytes), "remote" if "download" in stages else "disk", stages)

    return load


class Disk:
    """The local artifact cache, as far as the cache asks it: which digests it holds."""

    def __init__(self, digests: set[str]):
        self.digests = digests

    def has(self, digest: str) -> bool:
        return digest in self.digests


def make_cache(slots=2, cpu_mib=1000, download=frozenset(), disk=None):
    now = [0.0]
    cache = native_residency(
        Pool(slots),
        lambda files, hashed: None,
        cpu_bytes=cpu_mib * MiB,
        policy=ScorePolicy(),
        disk=disk,
        executor=Instant(),
        loader=loader(set(download)),
        clock=lambda: now[0],
    )
    return cache, now


def ref(name):
    return AdapterRef(AdapterKey("base", name, "1", f"sha256:{name}"), storage_uri=f"mem://{name}")


def serve(cache, r):
    """One request start to finish: counted, loaded if needed, run in a slot, released."""
    cache.record_request(r)
    slot = cache.acquire(r)
    if slot is None:
        cache.backend.poll()
        slot = cache.acquire(r)
    assert slot is not None
    cache.release(r.key)


def test_a_hot_adapter_pushed_out_by_a_one_off_comes_back_when_it_is_done():
    cache, now = make_cache(slots=2)
    hot, warm = ref("hot"), ref("warm")
    for _ in range(10):
        now[0] += 1.5
        serve(cache, hot)
        serve(cache, warm)
    now[0] += 1.5
    serve(cache, ref("one-off"))  # takes a slot from a gpu-warm adapter, then gives it back
    assert set(cache.backend.slots) == {hot.key, warm.key}


def test_a_restored_adapter_is_not_protected_until_a_request_uses_it():
    """The minimum residency protects a gpu-warm adapter loaded for its request; one the cache
    restored ahead of any request is a guess, and a request that needs its slot takes it without
    waiting (after the seed scenario, the restores of its stale hot adapters made the next
    traffic's requests wait for slots)."""
    cache, now = make_cache(slots=1)
    hot = ref("hot")
    for _ in range(10):
        now[0] += 1.5
        serve(cache, hot)
    now[0] += 1.5
    # the one-off takes the slot; the hot adapter is restored when it is done
    serve(cache, ref("one-off"))
    assert cache.backend.slots == [hot.key] and cache.entries[hot.key].restored
    now[0] += 0.1  # well within the minimum residency
    serve(cache, ref("another"))  # takes the slot at once (serve asserts a slot)
    assert cache.backend.slots == [hot.key]  # and hot is restored again
    now[0] += 0.1
    cache.record_request(hot)
    assert cache.acquire(hot) == 0 and not cache.entries[hot.key].restored  # used: protected again
    cache.release(hot.key)
    now[0] += 0.1
    third = ref("third")
    cache.record_request(third)
    # hot was loaded 0.2 s ago and has been used: the newcomer waits
    assert cache.acquire(third) is None


def test_no_restore_when_the_slots_turn_over_faster_than_the_adapter_comes_back():
    cache, now = make_cache(slots=2, cpu_mib=10_000)
    hot, rare = ref("hot"), ref("rare")
    for _ in range(3):
        now[0] += 1.5
        serve(cache, hot)
        serve(cache, rare)
    for i in range(40):  # a stream of distinct adapters: many slot loads for each request of `rare`
        now[0] += 1.5
        serve(cache, hot)
        serve(cache, ref(f"stream-{i}"))
    copies = cache.backend.pool.copies
    now[0] += 1.5
    serve(cache, ref("one-more"))
    assert rare.key not in cache.backend.slots  # not restored: it would only be pushed out again
    assert cache.backend.pool.copies == copies + 1  # the one-off's activation, no restore copy


def test_a_host_copy_of_an_adapter_in_a_slot_counts_its_activations_not_its_requests():
    """Except in the gpu warm set: a gpu-warm adapter pushed out of its slot is restored at once,
    and only its host copy makes that restore a copy rather than a load, so that copy keeps
    counting its requests."""
    cache, now = make_cache(slots=2)
    hot, other = ref("hot"), ref("other")
    for _ in range(20):
        now[0] += 1.5
        serve(cache, hot)
    serve(cache, other)
    now[0] += 5.0
    assert hot.key in cache.backend.slots and hot.key in cache.backend.placement.gpu_warm(
        cache.backend.snapshot(), now[0]
    )
    gpu_warm = {
        c.key: c
        for c in cache.backend.placement.host_candidates(
            cache.backend.snapshot(), [hot.key, other.key], now[0], by_use=True
        )
    }
    assert gpu_warm[hot.key].demand > 18
    cache.backend.max_gpu_warm = 0  # the same adapter outside the gpu warm set
    assert {a["name"]: a["warm"] for a in cache.state()["adapters"]} == {"hot": "B", "other": None}
    by_key = {
        c.key: c
        for c in cache.backend.placement.host_candidates(
            cache.backend.snapshot(), [hot.key, other.key], now[0], by_use=True
        )
    }
    assert by_key[hot.key].demand < 1.01  # activated once, however many requests its slot served
    assert by_key[hot.key].last_access == cache.entries[hot.key].loaded_at
    plain = {
        c.key: c
        for c in cache.backend.placement.host_candidates(
            cache.backend.snapshot(), [hot.key], now[0], by_use=False
        )
    }
    assert plain[hot.key].demand > 18  # what lru and the other baselines see
    slot_view = {
        c.key: c
        for c in cache.backend.placement.slot_candidates(
            cache.backend.snapshot(), [hot.key], now[0]
        )
    }
    assert slot_view[hot.key].demand > 18  # a slot eviction still weighs its requests


def test_reload_cost_is_measured_per_byte_and_includes_a_download_once_the_disk_lost_it():
    cache, now = make_cache(slots=1, download={"far"}, disk=Disk({"sha256:near"}))
    near, far = ref("near"), ref("far")
    serve(cache, near)
    serve(cache, far)
    assert cache.backend.seconds_per_byte == pytest.approx(
        {"disk": 1e-9, "download": 1e-8, "h2d": 1e-10}
    )
    costs = {
        c.key: c.reload_cost
        for c in cache.backend.placement.host_candidates(
            cache.backend.snapshot(), [near.key, far.key], now[0], by_use=True
        )
    }
    nbytes = 100 * MiB
    assert costs[near.key] == pytest.approx(nbytes * 1e-9)  # a disk read
    assert costs[far.key] == pytest.approx(
        nbytes * (1e-9 + 1e-8)
    )  # the disk does not hold it: a download too
    slot = {
        c.key: c.reload_cost
        for c in cache.backend.placement.slot_candidates(
            cache.backend.snapshot(), [far.key], now[0]
        )
    }
    assert slot[far.key] == pytest.approx(
        nbytes * 1e-10
    )  # in host memory: only the copy to the device


def warm_up(cache, now, refs, rounds=10):
    """Each adapter of `refs` requested once per 1.5 s, `rounds` times: all of them end up in the
    gpu warm set."""
    for _ in range(rounds):
        now[0] += 1.5
        for r in refs:
            serve(cache, r)


@pytest.mark.parametrize("policy", [ScorePolicy(), ScorePolicy(spares_waiting=False)])
def test_an_adapter_whose_request_waits_in_the_queue_keeps_its_slot(policy):
    cache, now = make_cache(slots=2)
    cache.policy = policy
    hot, other = ref("hot"), ref("other")
    warm_up(cache, now, [hot, other])
    now[0] += 5.0  # past every minimum residency
    cache.acquire(other)  # `other` runs; `hot` sits idle in its slot
    cache.record_request(hot)
    cache.backend.add_waiting(hot.key)  # ...with a request queued behind a one-off's
    one_off = ref("one-off")
    cache.record_request(one_off)
    cache.backend.add_waiting(one_off.key)
    cache.acquire(one_off)  # starts its load
    cache.backend.poll()
    slot = cache.acquire(one_off)
    if policy.spares_waiting:
        assert slot is None and hot.key in cache.backend.slots  # the one-off waits for a slot
        cache.backend.drop_waiting(hot.key)
        assert cache.acquire(hot) is not None  # the queued request is admitted on its adapter
    else:
        # the queued request lost its adapter
        assert slot is not None and hot.key not in cache.backend.slots
    assert (
        cache.backend.num_waiting == {one_off.key: 1}
        if policy.spares_waiting
        else {hot.key: 1, one_off.key: 1}
    )


@pytest.mark.parametrize("policy", [ScorePolicy(), ScorePolicy(yields_for_s=0.0)])
def test_a_freed_slot_goes_to_a_waiting_gpu_warm_adapter_before_a_one_off_that_came_first(policy):
    cache, now = make_cache(slots=2)
    cache.policy = policy
    hot, other, pushed = ref("hot"), ref("other"), ref("pushed")
    warm_up(cache, now, [hot, other, pushed])  # three gpu-warm adapters, two slots
    now[0] += 5.0
    running = [k for k in cache.backend.slots]
    for key in running:
        cache.acquire(cache.entries[key].ref)  # both slots busy
    waiting = next(r for r in (hot, other, pushed) if r.key not in running)
    one_off = ref("one-off")
    cache.record_request(one_off)
    assert cache.acquire(one_off) is None  # loading
    cache.backend.poll()
    assert cache.acquire(one_off) is None  # every slot busy: both wait, the one-off first in line
    assert cache.acquire(waiting) is None
    now[0] += 0.1
    cache.release(running[0])  # one slot frees
    if policy.yields_for_s:
        assert (
            cache.acquire(one_off) is None
        )  # it leaves the slot to the gpu-warm adapter behind it
        assert cache.acquire(waiting) is not None
        cache.release(running[1])
        assert cache.acquire(one_off) is not None  # and takes the next
    else:
        assert cache.acquire(one_off) is not None  # first come, first served
        assert cache.acquire(waiting) is None


def test_an_adapter_forgotten_while_it_loads_is_dropped_when_the_load_ends():
    class Deferred:
        """An executor whose load ends when the test says so."""

        def submit(self, fn, r) -> Future:
            self.run, self.future = (lambda: fn(r)), Future()
            return self.future

    executor = Deferred()
    cache = native_residency(
        Pool(2),
        lambda files, hashed: None,
        cpu_bytes=1000 * MiB,
        policy=ScorePolicy(),
        executor=executor,
        loader=loader(set()),
        clock=lambda: 0.0,
    )
    gone = ref("gone")
    cache.record_request(gone)
    assert cache.acquire(gone) is None  # loading
    cache.forget(gone.key)  # an unload while the load runs
    executor.future.set_result(executor.run())
    assert cache.backend.poll() == []
    assert gone.key not in cache.backend.cpu and gone.key not in cache.entries and not cache.loading
    assert cache.tiers.cpu_bytes_used == 0


def test_adapters_whose_traffic_stopped_leave_the_gpu_warm_set_and_keep_no_slot_for_their_count():
    """A change of traffic: two adapters busy for two minutes go silent and two others take over.
    The old ones' 5-minute counts stay far above the new ones' for minutes; after 20 of their
    mean gaps without a request they leave the gpu warm set, are not restored, and weigh nothing
    for their count when a slot is to be freed."""
    cache, now = make_cache(slots=2, cpu_mib=10_000)
    old, new = [ref("old-0"), ref("old-1")], [ref("new-0"), ref("new-1")]
    for _ in range(480):  # 4 requests a second for 2 minutes
        now[0] += 0.25
        serve(cache, old[0])
        serve(cache, old[1])
    stopped = now[0]
    for _ in range(30):
        now[0] += 1.0
        serve(cache, new[0])
        serve(cache, new[1])
        assert cache.demand.short(old[0].key, now[0]) > 10 * cache.demand.short(new[0].key, now[0])
        if now[0] - stopped < 5:  # not yet overdue: the old pair is still the gpu warm set
            assert cache.backend.placement.gpu_warm(cache.backend.snapshot(), now[0]) == {
                old[0].key,
                old[1].key,
            }
    assert cache.backend.placement.gpu_warm(cache.backend.snapshot(), now[0]) == {
        new[0].key,
        new[1].key,
    }
    assert set(cache.backend.slots) == {
        new[0].key,
        new[1].key,
    }  # the old pair was not restored after the switch
    weighed = {
        c.key: c
        for c in cache.backend.placement.slot_candidates(
            cache.backend.snapshot(), [k.key for k in new], now[0]
        )
    }
    assert all(c.warm and c.demand > 20 for c in weighed.values())
    stale = {
        c.key: c
        for c in cache.backend.placement.host_candidates(
            cache.backend.snapshot(), [k.key for k in old], now[0], by_use=False
        )
    }
    assert all(c.demand == 0.0 and not c.warm for c in stale.values())
    assert cache.backend.placement.cpu_warm(cache.backend.snapshot(), now[0]) == {
        new[0].key,
        new[1].key,
    }  # nor do they keep their place in the cpu warm set
    warm = {a["name"]: a["warm"] for a in cache.state()["adapters"]}  # as the admin state shows it
    assert warm == {"old-0": None, "old-1": None, "new-0": "A", "new-1": "A"}


def test_without_overdue_gaps_a_stale_count_keeps_the_gpu_warm_set():
    """The same traffic with the rule off (`overdue_gaps=None`): the old pair keeps the gpu warm
    set on its count."""
    cache, now = make_cache(slots=2, cpu_mib=10_000)
    cache.policy = ScorePolicy(overdue_gaps=None)
    old, new = [ref("old-0"), ref("old-1")], [ref("new-0"), ref("new-1")]
    for _ in range(480):
        now[0] += 0.25
        serve(cache, old[0])
        serve(cache, old[1])
    for _ in range(30):
        now[0] += 1.0
        serve(cache, new[0])
        serve(cache, new[1])
    assert cache.backend.placement.gpu_warm(cache.backend.snapshot(), now[0]) == {
        old[0].key,
        old[1].key,
    }


@pytest.mark.parametrize("pinned", [False, True])
def test_waiting_loads_leave_room_for_each_other_with_a_cpu_pin(pinned):
    """One slot busy, room for two host copies, two waiting requests: each loads once. A
    cpu-pinned copy takes one of the two places, so the second waits for the first to get its
    slot instead of pushing its copy out (the pin is never dropped: the shrink would drop the
    waiting one's copy, which would load again, every step)."""
    now, loads = [0.0], []

    def load(r):
        loads.append(r.key.name)
        return Loaded(Packed(100 * MiB), "disk", {"disk": 0.1})

    cache = native_residency(
        Pool(1),
        lambda f, h: None,
        cpu_bytes=1000 * MiB,
        max_cpu_loras=2,
        executor=Instant(),
        loader=load,
        clock=lambda: now[0],
    )
    if pinned:
        cache.pin(ref("P"), "cpu")
        cache.backend.poll()
    running = ref("X")
    cache.acquire(running)
    cache.backend.poll()
    assert cache.acquire(running) is not None  # X holds the only slot from now on
    first, second = ref("h"), ref("k")
    for _ in range(20):  # 20 steps: the two waiting requests ask in queue order
        now[0] += 0.05
        cache.acquire(first)
        cache.acquire(second)
        cache.backend.poll()
    assert loads.count("h") == 1 and loads.count("k") == (0 if pinned else 1), loads


def test_forgetting_an_adapter_whose_load_is_in_flight_leaves_no_waiting_mark():
    """unload_lora_adapter forgets an adapter whose load is still running, its waiting request
    gone: the next request for another adapter must not trip over the forgotten one's mark
    (KeyError on the step thread, which failed every request in flight)."""

    class Pending:  # a load that has not ended yet
        def submit(self, fn, r):
            return Future()

    now = [0.0]
    cache = native_residency(
        Pool(1),
        lambda f, h: None,
        cpu_bytes=1000 * MiB,
        executor=Pending(),
        loader=lambda r: Loaded(Packed(MiB), "disk", {}),
        clock=lambda: now[0],
    )
    gone, other = ref("x"), ref("k")
    assert cache.acquire(gone) is None and gone.key in cache.loading
    cache.forget(gone.key)
    now[0] += 0.5
    assert cache.acquire(other) is None and other.key in cache.loading
