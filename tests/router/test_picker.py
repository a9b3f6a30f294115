"""The router's picker over plain worker views."""

import random
from collections import Counter

import pytest

from loraplex.router.picker import Picker, PickerConfig, WorkerView


def w(url, **kw):
    return WorkerView(url, free_slots=kw.pop("free_slots", 0), **kw)


def test_affinity_prefers_gpu_then_cpu_resident_worker():
    workers = [w("a"), w("b", cpu=frozenset({"x"})), w("c", gpu=frozenset({"x"}))]
    pick = Picker(rng=random.Random(0)).pick(workers, "x")
    assert pick.url == "c" and pick.reason == "affinity-gpu" and pick.ranking[1] == "b"


def test_saturated_worker_is_skipped_until_all_are_saturated():
    hot = w("a", gpu=frozenset({"x"}), waiting=9)
    cool = w("b", cpu=frozenset({"x"}))
    assert Picker().pick([hot, cool], "x").url == "b"
    assert (
        Picker().pick([hot, w("b", waiting=8, cpu=frozenset({"x"}))], "x").reason
        == "saturated-fallback"
    )
    kv_full = w("a", gpu=frozenset({"x"}), kv_usage=0.95)
    assert Picker().pick([kv_full, cool], "x").url == "b"


def test_a_request_waiting_for_the_next_step_is_no_queue_where_the_worker_reports_its_capacity():
    """A worker's state counts a request as waiting from its arrival to the next step that admits
    it; with a free place for it that is no queue, and the worker keeps its adapters' traffic."""
    picker = Picker(config=PickerConfig(saturation_waiting=0))
    other = w("b", cpu=frozenset({"x"}), capacity=4, running=3)  # as loaded, not as well placed
    admitting = w("a", gpu=frozenset({"x"}), capacity=4, running=2, waiting=1)
    assert picker.pick([admitting, other], "x").reason == "affinity-gpu"
    assert picker.pick([admitting, other], "x").url == "a"
    beyond = w("a", gpu=frozenset({"x"}), capacity=4, running=4, waiting=1)
    assert picker.pick([beyond, other], "x").url == "b"
    sent_since = w("a", gpu=frozenset({"x"}), capacity=4, running=3, in_flight=2)
    assert picker.pick([sent_since, other], "x").url == "b"
    unknown = w("a", gpu=frozenset({"x"}), running=2, waiting=1)  # no capacity: all of it waits
    assert picker.pick([unknown, other], "x").url == "b"


def test_low_priority_is_shed_when_every_worker_is_saturated():
    busy = [w("a", waiting=9), w("b", waiting=7)]
    picker = Picker(config=PickerConfig(shed_priority_below=0))
    assert picker.pick(busy, "x", priority=-1).url is None
    assert picker.pick(busy, "x", priority=0).url is not None


def test_optimistic_in_flight_spreads_a_burst_between_polls():
    picker = Picker(rng=random.Random(1))
    workers = {u: w(u, gpu=frozenset({"x"})) for u in "abc"}
    counts = Counter()
    for _ in range(18):
        url = picker.pick(list(workers.values()), "x").url
        counts[url] += 1
        old = workers[url]
        workers[url] = WorkerView(url, gpu=old.gpu, in_flight=old.in_flight + 1)
    assert max(counts.values()) <= 8 and len(counts) == 3


def test_cold_adapters_hash_to_a_stable_worker_with_bounded_load():
    workers = [w(u, free_slots=1) for u in "abcd"]
    picker = Picker(rng=random.Random(2))
    first = {f"ad{i}": picker.pick(workers, f"ad{i}").url for i in range(40)}
    assert all(picker.pick(workers, a).reason == "cold-hash" for a in first)
    assert first == {a: picker.pick(workers, a).url for a in first}  # stable
    assert len(set(first.values())) == 4  # spread over the fleet
    # A loaded worker is skipped by the bounded load, its cold adapters go to the next on the ring.
    loaded = [WorkerView(x.url, free_slots=1, in_flight=20 if x.url == "a" else 0) for x in workers]
    assert all(picker.pick(loaded, a).url != "a" for a, url in first.items() if url == "a")


def test_higher_priority_tenant_takes_the_less_loaded_of_near_equal_workers():
    workers = [w("a", gpu=frozenset({"x"}), running=3), w("b", gpu=frozenset({"x"}), running=2)]
    cfg = PickerConfig(w_queue=0.01, near_equal=0.05)
    assert Picker(config=cfg).pick(workers, "x", priority=5).url == "b"


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "pure-affinity"])
def test_comparison_policies(policy):
    workers = [w("a", running=5, gpu=frozenset({"x"})), w("b", running=1), w("c", running=2)]
    picker = Picker(policy=policy, rng=random.Random(0))
    urls = [picker.pick(workers, "x").url for _ in range(3)]
    if policy == "round-robin":
        assert sorted(urls) == ["a", "b", "c"]
    elif policy == "least-loaded":
        assert urls == ["b"] * 3
    else:
        assert urls == ["a"] * 3


def test_dead_and_stale_workers():
    workers = [
        w("a", healthy=False, gpu=frozenset({"x"})),
        w("b", fresh=False, gpu=frozenset({"x"})),
        w("c"),
    ]
    pick = Picker().pick(workers, "x")
    assert "a" not in pick.ranking[:2] and pick.url in ("b", "c")
    assert Picker().pick([w("a", healthy=False)], "x").url is None
    with pytest.raises(ValueError):
        Picker(policy="nope")


def test_queue_depth_outweighs_affinity_only_by_whole_requests():
    """At the defaults each request of load costs 0.1: a gpu-resident worker keeps its adapter's
    traffic until it carries two more requests than a cpu-resident one or three more than a worker
    with a free slot."""
    picker = Picker(rng=random.Random(3))
    for load, expected in ((0, "a"), (1, "a"), (2, "a"), (3, "b"), (4, "b")):
        workers = [w("a", gpu=frozenset({"x"}), running=load), w("b", free_slots=1)]
        assert picker.pick(workers, "x").url == expected, load
    for load, expected in ((1, "a"), (2, "b")):
        workers = [w("a", gpu=frozenset({"x"}), running=load), w("b", cpu=frozenset({"x"}))]
        assert picker.pick(workers, "x").url == expected, load
    # Against a worker with no free slot (a cold load and an eviction there) affinity holds until
    # saturation.
    workers = [w("a", gpu=frozenset({"x"}), running=4), w("b")]
    assert picker.pick(workers, "x").url == "a"
    # Resident on two workers: the less loaded one takes it.
    workers = [w("a", gpu=frozenset({"x"}), running=3), w("b", gpu=frozenset({"x"}), running=1)]
    assert picker.pick(workers, "x").url == "b"
