"""What the cache keeps instead of recomputing: the host copies' byte total and the gpu and cpu
warm sets (no torch)."""

import contextlib
import random
from concurrent.futures import Future

import pytest

from loraplex.engines.native.slots import WANTED_FOR_S, Loaded, native_residency
from loraplex.residency.errors import CapacityExceeded
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import LRUPolicy, ScorePolicy

MiB = 2**20


class Packed:
    def __init__(self, nbytes):
        self.nbytes = nbytes


class Pool:
    def __init__(self, num_slots):
        self.num_slots = num_slots

    def set_slot(self, slot, packed):
        return 0.001

    def clear_slot(self, slot):
        pass


class Loads:
    """An executor whose loads end when the test says (`finish`), as the simulator's do."""

    def __init__(self):
        self.pending = []

    def submit(self, fn, ref):
        future = Future()
        self.pending.append((fn, ref, future))
        return future

    def finish(self, rng):
        rng.shuffle(self.pending)
        for fn, ref, future in self.pending[: rng.randint(0, len(self.pending))]:
            future.set_result(fn(ref))
            self.pending.remove((fn, ref, future))


def fresh_room_for(cache, key, now):
    """`room_for` computed without what it keeps: every waiting request's key walked each time."""
    entries = cache.entries
    held = [
        k
        for k, asked in cache.backend._wanted.items()
        if k != key
        and k in entries
        and now - asked <= WANTED_FOR_S
        and (k in cache.backend.cpu or k in cache.loading)
    ]
    if not held:
        return True
    pinned = [e for k, e in entries.items() if e.pinned == "cpu" and k not in held]
    if (
        cache.backend.max_cpu_loras is not None
        and len(pinned) + len(held) + 1 > cache.backend.max_cpu_loras
    ):
        return False
    held_bytes = sum(e.nbytes for e in pinned) + sum(entries[k].nbytes for k in held)
    return held_bytes + entries[key].nbytes <= cache.backend.cpu_bytes


def fresh_warm_sets(cache, now):
    """The gpu and cpu warm sets computed again, nothing kept."""
    placement, snap = cache.backend.placement, cache.backend.snapshot()
    memo, placement.warm_memo = placement.warm_memo, {}
    try:
        return placement.gpu_warm(snap, now), placement.cpu_warm(snap, now)
    finally:
        placement.warm_memo = memo


@pytest.mark.parametrize("seed", range(24))
def test_byte_total_and_warm_sets_follow_every_change(seed):
    rng = random.Random(seed)
    now = [0.0]
    sizes = {i: rng.choice([3, 5, 8, 13]) * MiB for i in range(12)}
    refs = [
        AdapterRef(AdapterKey("base", f"a{i}", "1", f"sha256:{i}"), storage_uri=f"mem://{i}")
        for i in sizes
    ]
    loads = Loads()
    cache = native_residency(
        Pool(3),
        lambda files, hashed: None,
        cpu_bytes=30 * MiB,
        max_cpu_loras=rng.choice([None, 5]),
        policy=ScorePolicy() if seed % 2 else LRUPolicy(),
        executor=loads,
        clock=lambda: now[0],
        loader=lambda ref: Loaded(
            Packed(sizes[refs.index(ref)]), "remote", {"download": 0.01, "disk": 0.002}
        ),
    )
    held = []
    for _ in range(400):
        now[0] += rng.choice([0.0, 0.05, 0.5, 3.0])
        ref = rng.choice(refs)
        op = rng.choice(
            [
                "request",
                "request",
                "request",
                "release",
                "poll",
                "evict",
                "forget",
                "pin",
                "gpu_cap",
            ]
        )
        if op == "request":
            cache.record_request(ref)
            if cache.acquire(ref) is not None:
                held.append(ref.key)
        elif op == "release" and held:
            cache.release(held.pop(rng.randrange(len(held))))
        elif op == "poll":
            loads.finish(rng)
            cache.backend.poll()
        elif op == "evict" and ref.key not in held:
            cache.evict(ref.key)
        elif op == "forget" and ref.key not in held and ref.key not in cache.loading:
            cache.forget(ref.key)
        elif op == "pin":
            if rng.random() < 0.5:
                cache.unpin(ref.key)
            else:
                with contextlib.suppress(CapacityExceeded):
                    cache.pin(ref, "cpu")
        elif op == "gpu_cap":
            cache.backend.max_gpu_warm = rng.choice([0, 1, 3])
        assert cache.tiers.cpu_bytes_used == sum(p.nbytes for p in cache.backend.cpu.values())
        for tier, pins in (
            ("gpu", cache.ledger.pinned_to["gpu"]),
            ("cpu", cache.ledger.pinned_to["cpu"]),
        ):
            assert pins == {k for k, e in cache.entries.items() if e.pinned == tier}
        for key in [
            r.key for r in refs if r.key in cache.entries
        ]:  # kept between calls, and the same answers
            room = cache.backend.placement.room_for(cache.backend.snapshot(), key, now[0])
            assert room == fresh_room_for(cache, key, now[0]), key
        # Asked twice, with and without what was kept: the same sets, in the same order.
        for _ in range(2):
            snap = cache.backend.snapshot()
            kept = (
                cache.backend.placement.gpu_warm(snap, now[0]),
                cache.backend.placement.cpu_warm(snap, now[0]),
            )
            fresh = fresh_warm_sets(cache, now[0])
            assert [list(s) for s in kept] == [list(s) for s in fresh]
