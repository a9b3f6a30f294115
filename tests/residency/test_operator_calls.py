"""Operator calls (pin, prewarm, evict, forget) against loads in flight and failed loads (no
torch)."""

import threading
from concurrent.futures import Future

from test_cache_bookkeeping import MiB, Packed, Pool  # the same plain stand-ins

from loraplex.engines.native.slots import Loaded, native_residency
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.events import PinRefused
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import ScorePolicy


class Deferred:
    """An executor whose loads finish when the test says so (as a worker thread would, some time
    later)."""

    def __init__(self):
        self.pending = []

    def submit(self, fn, ref) -> Future:
        future: Future = Future()
        self.pending.append((fn, ref, future))
        return future

    def finish(self):
        for fn, ref, future in self.pending:
            try:
                future.set_result(fn(ref))
            except Exception as exc:  # noqa: BLE001 (the cache reads it from the future)
                future.set_exception(exc)
        self.pending.clear()


def ref(name):
    return AdapterRef(AdapterKey("base", name, "1", f"sha256:{name}"), storage_uri=f"mem://{name}")


def make_cache(slots=1, cpu_mib=1000, failing=(), events=None):
    now, executor, failing = [0.0], Deferred(), set(failing)

    def load(r):
        if r.key.name in failing:
            raise AdapterUnavailable(f"{r.key.name}: store down")
        return Loaded(Packed(100 * MiB), "disk", {"disk": 0.1})

    cache = native_residency(
        Pool(slots),
        lambda files, hashed: None,
        cpu_bytes=cpu_mib * MiB,
        policy=ScorePolicy(),
        executor=executor,
        loader=load,
        clock=lambda: now[0],
    )
    if events is not None:
        cache.on_event = events.append
    return cache, now, executor, failing


def land(cache, executor):
    executor.finish()
    return cache.backend.poll()


def test_a_cpu_pin_that_does_not_fit_once_its_size_is_known_is_dropped_when_it_lands():
    """Before its first load an adapter's size is unknown (0), so pin(cpu) cannot refuse it; when
    the bytes land and the pins would overfill host memory, the late pin is dropped with an event,
    and the copy is an ordinary one that the next load may push out. The pin that fitted stays."""
    events = []
    cache, now, executor, _ = make_cache(slots=2, cpu_mib=150, events=events)
    a, b, c = ref("a"), ref("b"), ref("c")
    cache.pin(a, "cpu")
    cache.pin(b, "cpu")  # accepted: nothing is known of either's size yet
    land(cache, executor)
    assert cache.entries[a.key].pinned == "cpu" and cache.entries[b.key].pinned is None
    refused = [e for e in events if isinstance(e, PinRefused)]
    assert [e.key for e in refused] == [b.key] and "exceed cpu_cache_bytes" in refused[0].error
    cache.prewarm(c, "cpu")
    land(cache, executor)  # the next load pushes the unpinned copy out; the pinned one stays
    assert a.key in cache.backend.cpu and b.key not in cache.backend.cpu
    # The pin fills the budget: the copy that just landed is kept for its request, the tier over by
    # that copy alone.
    assert cache.tiers.cpu_bytes_used - cache.backend.cpu[c.key].nbytes <= cache.backend.cpu_bytes


def test_a_failed_gpu_prewarm_does_not_send_a_later_cpu_load_into_a_slot():
    cache, now, executor, failing = make_cache(slots=1, failing={"x"})
    x, hot = ref("x"), ref("hot")
    cache.prewarm(hot, "gpu")
    land(cache, executor)
    cache.prewarm(x, "gpu")
    assert [k for k, _ in land(cache, executor)] == [x.key]
    failing.clear()
    now[0] += 3600
    cache.prewarm(x, "cpu")  # host memory only
    land(cache, executor)
    assert cache.backend.slots == [hot.key] and x.key in cache.backend.cpu
    assert cache.entries[hot.key].evictions == 0


def test_a_gpu_prewarm_without_a_slot_is_not_left_pending():
    cache, now, executor, _ = make_cache(slots=1)
    x, busy = ref("x"), ref("busy")
    cache.prewarm(x, "cpu")
    land(cache, executor)
    cache.record_request(busy)
    cache.acquire(busy)
    land(cache, executor)
    assert cache.acquire(busy) == 0  # in flight: its slot cannot be taken
    cache.prewarm(x, "gpu")  # in cpu, no slot to be had: stays in cpu
    assert cache.backend.slots == [busy.key]
    # Nothing is left pending: a later load of x (after its copy was pushed out) would put it in a
    # slot.
    assert not cache.entries[x.key].prewarm_gpu


def test_evict_during_a_gpu_prewarm_keeps_the_adapter_out_of_the_slots():
    cache, now, executor, _ = make_cache(slots=1)
    hot, x = ref("hot"), ref("x")
    cache.prewarm(hot, "gpu")
    land(cache, executor)
    cache.prewarm(x, "gpu")  # load in flight
    cache.evict(x.key)  # "drop from gpu and cpu now"
    now[0] += 1
    land(cache, executor)  # the load was not cancelled: it lands in cpu, not in a slot
    assert cache.backend.slots == [hot.key]


def test_forget_is_one_step_for_the_step_loop():
    """forget evicts and drops the bookkeeping under one lock hold: a step thread that takes the
    lock in between (here, run from inside evict, where a thread switch would put it) cannot put the
    adapter in a slot and then find its entry gone (KeyError on release and on every later slot
    eviction)."""
    cache, now, executor, _ = make_cache(slots=1)
    x, y = ref("x"), ref("y")
    cache.prewarm(x, "cpu")  # a load in flight
    evict, seen = cache.evict, []

    def evict_then_the_step_thread_runs(key):
        evict(key)

        def step():  # blocks on the cache's lock while forget holds it
            land(cache, executor)
            cache.record_request(x)
            seen.append(cache.acquire(x))

        thread = threading.Thread(target=step)
        thread.start()
        thread.join(timeout=0.2)
        seen.append(thread)

    cache.evict = evict_then_the_step_thread_runs
    cache.forget(x.key)
    seen[0].join(timeout=10)  # runs once forget lets go of the lock
    # its load starts again: it was forgotten, not left in a slot without an entry
    assert seen[1] is None
    assert x.key not in cache.backend.slots
    land(cache, executor)
    assert cache.acquire(x) == 0
    cache.release(x.key)  # no KeyError
    now[0] += 1
    cache.record_request(y)
    cache.acquire(y)
    land(cache, executor)
    assert cache.acquire(y) == 0  # a later slot eviction (x's slot) works


def test_a_gpu_pin_made_while_every_slot_is_busy_takes_the_first_slot_that_frees():
    """Pinned to gpu while both slots run requests: its load lands in cpu with no slot to take. It
    takes the first slot that a finished request leaves, when no request waits for one, rather than
    stay in cpu for good ("pinned: gpu", tier cpu) while unpinned adapters keep the slots."""
    cache, now, executor, _ = make_cache(slots=2)
    busy = [ref("a"), ref("b")]
    for r in busy:
        cache.record_request(r)
        cache.acquire(r)
    land(cache, executor)
    assert [cache.acquire(r) for r in busy] == [0, 1]
    pinned = ref("p")
    cache.pin(pinned, "gpu")
    land(cache, executor)
    assert pinned.key in cache.backend.cpu and cache.tiers.slot_of(pinned.key) is None
    now[0] += 5.0
    cache.release(busy[0].key)
    assert cache.tiers.slot_of(pinned.key) is not None and cache.entries[pinned.key].pinned == "gpu"
    cache.release(busy[1].key)
    assert busy[1].key in cache.backend.slots  # one pin takes one slot


def test_when_loaded_is_done_once_poll_takes_the_load_in():
    cache, _, executor, _ = make_cache()
    x = ref("x")
    assert cache.when_loaded(x.key).done()  # nothing loads: done at once
    cache.prewarm(x, "cpu")
    waited = cache.when_loaded(x.key)
    executor.finish()
    assert not waited.done()  # the load ended; the step loop has not taken it in yet
    cache.backend.poll()
    assert waited.done() and cache.in_host_memory(x.key)


def test_when_released_is_done_with_the_last_reference():
    cache, _, executor, _ = make_cache()
    x = ref("x")
    cache.acquire(x)
    executor.finish()
    cache.backend.poll()
    assert cache.acquire(x) is not None and cache.acquire(x) is not None  # two requests hold it
    waited = cache.when_released(x.key)
    cache.release(x.key)
    assert not waited.done()
    cache.release(x.key)
    assert waited.done()
    cache.forget(x.key)
    assert cache.when_released(x.key).done()  # an adapter the cache does not know is held by none
