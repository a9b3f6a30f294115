"""Discrete-event simulation of workers running the real adapter cache, policies and router picker.

Nothing of the cache is re-implemented: each simulated worker owns a real `Residency` on the native
backend, whose clock is the simulation's, whose slot pool records host-to-device copies instead of
moving tensors, whose executor is this event loop (a load's future completes at its simulated finish
time) and whose loader models the disk and remote tiers by bandwidth and fixed latency. A worker's
step is the engine's: the running requests decode one token each, then waiting requests are admitted
by the scheduler's own rule (`loraplex.engines.native.admission.admit_waiting`), and a request holds
its adapter's slot until it finishes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from loraplex.engines.native.adapter_load import Loaded
from loraplex.engines.native.admission import Take, admit_waiting
from loraplex.engines.native.slots import native_residency
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.router.picker import Picker, WorkerView
from loraplex.sim.backend import SimDisk, SimKey, SimPacked, SimPool, _label
from loraplex.sim.config import ENGINES, LLAMA7B_BYTES_PER_RANK, TIERS, SimConfig, config_dict
from loraplex.sim.epp import EppPicker
from loraplex.sim.fair_share import FairShare
from loraplex.sim.placement import Controller, ControllerConfig
from loraplex.sim.policies import policy_factory
from loraplex.sim.pools import PoolRouting
from loraplex.sim.prefix_cache import PrefixModel
from loraplex.sim.registry_load import RegistryLoad, registry_changes
from loraplex.sim.virtual_loop import VirtualLoop
from loraplex.sim.vllm_worker import VllmWorker
from loraplex.sim.workload import Request

__all__ = [
    "ENGINES",
    "LLAMA7B_BYTES_PER_RANK",
    "TIERS",
    "SimConfig",
    "SimRequest",
    "Simulation",
    "config_dict",
    "policy_factory",
    "simulate",
]


# -- requests and workers --------------------------------------------------------------------------
class SimRequest:
    __slots__ = (
        "admitted_at",
        "blocks",
        "cached",
        "finish_at",
        "first_token_at",
        "nbytes",
        "ref",
        "req",
        "tier",
        "worker",
    )

    def __init__(self, req: Request, ref: AdapterRef | None, nbytes: int):
        self.req, self.ref, self.nbytes = req, ref, nbytes
        self.tier = "gpu"
        self.worker = 0
        self.admitted_at = self.first_token_at = self.finish_at = math.nan
        self.blocks: tuple[int, ...] = ()  # its prompt's hash chain (`sim.prefix_cache`)
        self.cached = 0  # its prompt's tokens found in its worker's KV cache


class Worker:
    def __init__(self, sim: Simulation, index: int, policy):
        c = sim.config
        self.sim, self.index = sim, index
        self.url = f"worker-{index}"
        self.pool = SimPool(c.gpu_slots, c.costs.h2d)
        self.disk = SimDisk(c.disk_bytes)
        self.cache = native_residency(
            self.pool,
            lambda path: None,
            cpu_bytes=c.cpu_bytes,
            max_cpu_loras=c.max_cpu_loras,
            disk=self.disk,
            policy=policy,
            budgets=c.budgets(),
            executor=self,
            loader=self._load,
            clock=sim.clock,
        )
        self.waiting: deque[SimRequest] = deque()
        self.num_running = 0
        self.running_tokens = 0
        self.running_adapters: Counter = Counter()
        self.finishing: list[tuple[int, int, SimRequest]] = []  # (finish step, order, request)
        self.prefill_order = itertools.count()  # ties in `finishing` end in prefill order
        self.step_index = 0
        self.steps_in_flight = 1  # engine steps the scheduled step end stands for
        self.end_token = 0  # the scheduled step end that counts (an arrival may move it earlier)
        self.quiet: tuple[float, float, list[AdapterKey]] | None = None  # (first end, step s, keys)
        self.touch: tuple[list[AdapterKey], float] | None = None  # keys, when the last step is
        self.load_ends: list[float] = []  # when this worker's loads in progress end (a heap)
        self.loads_landed = 0  # loads ended since the cache last polled
        self.busy = False
        self.retry_scheduled = False
        self.prefilled: list[SimRequest] = []
        self._plans: dict[AdapterKey, tuple[str, dict[str, float], int]] = {}
        self.load_seconds = 0.0
        self.loads: Counter = Counter()
        self.peak_cpu_bytes = 0
        self.peak_slots = 0

    # The cache's executor: a load's future completes at its simulated finish time.
    def submit(self, fn: Callable, ref: AdapterRef) -> Future:
        nbytes = self.sim.nbytes[ref.key]
        if ref.path is not None or self.disk.has(ref.key.adapter_digest):
            source, stages = "disk", {"disk": self.sim.config.costs.disk.seconds(nbytes)}
        else:
            source = "remote"
            stages = {
                "download": self.sim.config.costs.remote.seconds(nbytes),
                "disk": self.sim.config.costs.disk.seconds(nbytes),
            }
        self._plans[ref.key] = (source, stages, nbytes)
        future: Future = Future()
        end = self.sim.now + sum(stages.values())
        heapq.heappush(self.load_ends, end)
        self.sim.schedule(end, self._finish_load, (fn, ref, future))
        return future

    def _finish_load(self, payload) -> None:
        fn, ref, future = payload
        heapq.heappop(self.load_ends)
        self.loads_landed += 1
        future.set_result(fn(ref))
        self.wake()

    def _load(self, ref: AdapterRef) -> Loaded:
        source, stages, nbytes = self._plans.pop(ref.key)
        if ref.path is None:
            self.disk.use(ref.key.adapter_digest, nbytes)
        self.load_seconds += sum(stages.values())
        self.loads[source] += 1
        return Loaded(SimPacked(nbytes), source, stages)

    # Requests.
    def arrive(self, seq: SimRequest) -> None:
        seq.worker = self.index
        seq.tier = self.cache.record_request(seq.ref) if seq.ref is not None else "gpu"
        self.waiting.append(seq)
        if seq.ref is not None:
            self.cache.backend.add_waiting(seq.ref.key)
        if self.quiet is not None:
            self._cut_quiet_steps()
        self.wake()

    def wake(self) -> None:
        if not self.busy:
            self.start_step()

    # The step loop.
    def start_step(self) -> None:
        sim, config, cache = self.sim, self.sim.config, self.cache
        now = sim.now
        if self.loads_landed:  # the cache's poll can only take in loads that have ended
            self.loads_landed = 0
            took = len(cache.loading)
            cache.backend.poll()
            if len(cache.loading) != took:
                self._check_capacity()
        decodes = self.num_running
        budget = config.max_num_batched_tokens - decodes
        admitted: list[SimRequest] = []

        def has_room(seq: SimRequest) -> bool:
            return self.num_running < config.max_num_seqs and seq.req.prompt_tokens <= budget

        def admit(seq: SimRequest) -> None:
            nonlocal budget
            self._admit(seq, now)
            admitted.append(seq)
            budget -= seq.req.prompt_tokens

        step = admit_waiting(
            self._in_turn(),
            has_room=has_room,
            adapter_of=_adapter_key,
            take_adapter=lambda seq: self._take_adapter(seq.ref, now),
            admit=admit,
        )
        prefill_tokens = sum(seq.req.prompt_tokens - seq.cached for seq in admitted)
        copies = self.pool.take_uncharged()
        if admitted:
            self.peak_slots = max(self.peak_slots, self.pool.num_slots - cache.tiers.free_slots())
        if not decodes and not admitted:
            self.busy = False
            if self.waiting and not len(cache.loading) and not self.retry_scheduled:
                self.retry_scheduled = (
                    True  # nothing will wake it: look again shortly (as the engine loop does)
                )
                sim.schedule(now + config.idle_poll_s, self._retry, None)
            return
        self.busy = True
        self.prefilled = admitted
        step_s = config.service.step_seconds(prefill_tokens, decodes, len(self.running_adapters))
        end, self.steps_in_flight = now + (step_s + copies), 1
        if config.skip_quiet_steps and not admitted and not step.refused:
            end = self._skip_quiet_steps(end, step_s, list(step.blocked))
        self._schedule_end(end)

    def _in_turn(self) -> list[SimRequest]:
        """The waiting requests in arrival order, those their tenant's budget holds back after the
        others (as the engine's scheduler orders them)."""
        waiting, cache = list(self.waiting), self.cache
        if not cache.backend.budget_waiting:
            return waiting
        held = {id(s) for s in waiting if s.ref is not None and cache.backend.defers(s.ref)}
        return [s for s in waiting if id(s) not in held] + [s for s in waiting if id(s) in held]

    def _skip_quiet_steps(self, end: float, step_s: float, blocked: list[AdapterKey]) -> float:
        """The end of the last of the decode-only steps that follow this one and change nothing.

        A step changes nothing when none of the running requests finishes with it, no load of this
        worker ends before it does, no request arrives (an arrival cuts the steps short:
        `_cut_quiet_steps`) and no waiting request can be admitted (each waits for a load or a
        slot). Other workers' events cannot reach this one. The boundaries are added up one by one,
        as stepping would, so that every time is the same to the last bit. The skipped steps' one
        side effect, waiting requests touching their adapters, is made when they end.
        """
        first_end = end
        horizon = self.load_ends[0] if self.load_ends else math.inf
        if len(self.sim.workers) == 1:
            # every arrival is this worker's: end there rather than be cut short
            horizon = min(horizon, self.sim.next_arrival_time())
        finish_in = self.finishing[0][0] - self.step_index if self.finishing else math.inf
        last = None
        while self.steps_in_flight < finish_in and end < horizon:
            last, end = end, end + step_s
            self.steps_in_flight += 1
        if last is not None:
            self.quiet = (first_end, step_s, blocked)
            self.touch = (blocked, last)
        return end

    def _cut_quiet_steps(self) -> None:
        """A request arrived during skipped steps: they end at the first boundary at or after now,
        where the step loop would have seen it."""
        end, step_s, blocked = self.quiet
        self.quiet = None
        now, steps, last = self.sim.now, 1, None
        while end < now:
            last, end = end, end + step_s
            steps += 1
        if steps < self.steps_in_flight:
            self.steps_in_flight = steps
            self.touch = None if last is None else (blocked, last)
            self._schedule_end(end)

    def _take_adapter(self, ref: AdapterRef, now: float) -> Take:
        cache = self.cache
        if self.sim.config.skip_blocked and self._acquire_can_only_fail(ref.key):
            cache.backend.record_wait(ref.key, now)  # what the failed acquire would have recorded
            return Take.BLOCKED
        if cache.acquire(ref) is not None:
            return Take.TAKEN
        return Take.BLOCKED if cache.is_loading(ref.key) else Take.REFUSED

    def _admit(self, seq: SimRequest, now: float) -> None:
        self.waiting.remove(seq)
        seq.admitted_at = now
        if self.sim.prefixes is not None:
            seq.cached = self.sim.prefixes.prefill(self.index, seq.req, seq.blocks)
        self.num_running += 1
        self.running_tokens += seq.req.prompt_tokens + seq.req.output_tokens
        if seq.ref is not None:
            self.cache.backend.drop_waiting(seq.ref.key)
            self.running_adapters[seq.ref.key] += 1
            self.sim.admitted(seq)

    def _acquire_can_only_fail(self, key: AdapterKey) -> bool:
        """The adapter is loading, or in host memory while every slot is held by running requests
        (the cache would rank every adapter only to find no victim)."""
        cache = self.cache
        if cache.tiers.in_slot(key):
            return False
        # Each running adapter holds one slot (and the simulator pins none).
        every_slot_held = len(self.running_adapters) == self.pool.num_slots
        return cache.is_loading(key) or (cache.in_host_memory(key) and every_slot_held)

    def _schedule_end(self, end: float) -> None:
        self.end_token += 1
        self.sim.schedule(end, self._end_step, self.end_token)

    def _retry(self, _) -> None:
        self.retry_scheduled = False
        self.wake()

    def _end_step(self, token: int) -> None:
        if token != self.end_token:
            return  # moved earlier by an arrival
        self.quiet = None
        if self.touch is not None:
            keys, last = self.touch
            self.touch = None
            self.cache.backend.touch_waiting(keys, last)
        now = self.sim.now
        self.step_index += self.steps_in_flight
        for seq in self.prefilled:
            seq.first_token_at = now
            heapq.heappush(
                self.finishing,
                (self.step_index + seq.req.output_tokens - 1, next(self.prefill_order), seq),
            )
        self.prefilled = []
        while self.finishing and self.finishing[0][0] <= self.step_index:
            _, _, seq = heapq.heappop(self.finishing)
            self._finish(seq, now)
        self.start_step()

    def _finish(self, seq: SimRequest, now: float) -> None:
        seq.finish_at = now
        self.num_running -= 1
        self.running_tokens -= seq.req.prompt_tokens + seq.req.output_tokens
        if seq.ref is not None:
            key = seq.ref.key
            self.running_adapters[key] -= 1
            if not self.running_adapters[key]:
                del self.running_adapters[key]
            self.cache.release(key, seq.ref.tenant)
        self.sim.done(seq)

    def _check_capacity(self) -> None:
        self.peak_cpu_bytes = max(self.peak_cpu_bytes, self.cache.tiers.cpu_bytes_used)

    def view(self) -> WorkerView:
        """What the router polls from the worker's /admin/state."""
        cache = self.cache
        return WorkerView(
            self.url,
            waiting=len(self.waiting),
            running=self.num_running,
            active_tokens=self.running_tokens,
            recent_evictions=cache.ledger.num_recent_evictions(self.sim.now),
            free_slots=cache.tiers.free_slots(),
            gpu=frozenset(map(_label, cache.tiers.in_slots())),
            cpu=frozenset(map(_label, cache.tiers.in_host())),
            loading=frozenset(map(_label, list(cache.loading))),
        )


def _adapter_key(seq: SimRequest) -> AdapterKey | None:
    return None if seq.ref is None else seq.ref.key


# -- the simulation --------------------------------------------------------------------------------
class Simulation:
    def __init__(
        self,
        trace: list[Request],
        config: SimConfig,
        policy_factory: Callable[[Simulation], object],
        controller: ControllerConfig | None = None,
    ):
        """`controller`: the placement controller's settings, for `config.routing` controller."""
        self.trace, self.config = trace, config
        self.now = 0.0
        self._next = 0  # the next request to arrive
        self._events: list = []
        self._order = 0
        self.finished = 0
        self.refs: dict[str, AdapterRef] = {}
        self.nbytes: dict[AdapterKey, int] = {}
        self.requests = [self._request(r) for r in trace]
        if unknown := [model for model, _ in config.pins if model not in self.refs]:
            raise ValueError(f"pins name {', '.join(unknown)}, which no request of the trace names")
        self._arrivals: dict[AdapterKey, list[float]] = {}
        for seq in self.requests:
            if seq.ref is not None:
                self._arrivals.setdefault(seq.ref.key, []).append(seq.req.time)
        self._admitted: Counter = Counter()
        # the vLLM engine's residency runs on an event loop: the simulation's clock is its clock
        self.loop = VirtualLoop() if config.engine == "vllm" else None
        kind = Worker if self.loop is None else VllmWorker
        self.workers: list = [kind(self, i, policy_factory(self)) for i in range(config.workers)]
        self.picker = Picker(config.router, rng=random.Random(config.seed))
        self.pools = PoolRouting(config.pools, self.picker) if config.pools else None
        blocks = config.kv_prefix_blocks
        self.prefixes = PrefixModel(config.workers, blocks, blocks) if blocks else None
        weights, limit = dict(config.tenant_weights), config.queue_per_tenant
        self.fair = FairShare(self, weights, limit) if config.fair_share else None
        self.refused = 0  # requests no pool open to their tenant serves
        self._views: list[WorkerView] = []
        self._views_at = -math.inf
        self.open = [0] * config.workers  # per worker, the requests routed there and not ended
        self.span_s = trace[-1].time if trace else 0.0
        changes = registry_changes(trace, config.registry_changes_per_s, config.seed)
        self.registry = RegistryLoad(config.workers, changes, half_at=self.span_s / 2)
        # `--routing` (sim/placement.py): the EPP's scorers, or the controller's placements first
        self.epp = EppPicker(config, seed=config.seed) if config.routing == "epp" else None
        self.controller = None
        if config.routing == "controller":
            self.controller = Controller(self, controller or ControllerConfig())
            self.schedule(self.controller.config.interval_s, self.controller.tick, None)

    def clock(self) -> float:
        return self.now if self.loop is None else self.loop.time()

    def next_use(self, key: AdapterKey) -> float:
        """When the adapter is next needed: the arrival of its earliest request not yet admitted
        (for oracles)."""
        times = self._arrivals.get(key, ())
        k = self._admitted[key]
        return times[k] if k < len(times) else math.inf

    def request_counts(self) -> dict[AdapterKey, int]:
        """Requests per adapter over the whole trace (for the popularity oracle)."""
        return {key: len(times) for key, times in self._arrivals.items()}

    def admitted(self, seq: SimRequest) -> None:
        self._admitted[seq.ref.key] += 1

    def _request(self, r: Request) -> SimRequest:
        if r.adapter is None:
            return SimRequest(r, None, 0)
        model = r.model
        ref = self.refs.get(model)
        if ref is None:
            key = SimKey("sim-base", r.adapter, r.revision, f"sha256:{model}")
            path = Path(f"/sim/{model}") if self.config.local_adapters else None
            ref = AdapterRef(
                key,
                path=path,
                storage_uri=None if path else f"sim://{model}",
                tenant=r.tenant,
                priority=r.priority,
            )
            self.refs[model] = ref
            sizes = self.config.adapter_bytes or {}
            self.nbytes[key] = sizes.get(model, r.rank * self.config.bytes_per_rank)
        return SimRequest(r, ref, self.nbytes[ref.key])

    def schedule(self, at: float, fn: Callable, payload) -> None:
        self._order += 1
        heapq.heappush(self._events, (at, self._order, fn, payload))

    def next_arrival_time(self) -> float:
        return self.requests[self._next].req.time if self._next < len(self.requests) else math.inf

    def pin(self) -> None:
        """The configured operator's pins, on every worker."""
        for model, tier in self.config.pins:
            for worker in self.workers:
                worker.cache.pin(self.refs[model], tier)

    def run(self) -> Simulation:
        if self.loop is None:
            self.pin()
        else:
            try:
                self.loop.run_until_complete(self._run_on_loop())
            finally:
                self.loop.close()
            return self
        requests, events = self.requests, self._events
        while self._next < len(requests) or events:
            i = self._next
            next_arrival = requests[i].req.time if i < len(requests) else math.inf
            next_event = events[0][0] if events else math.inf
            if next_arrival <= next_event and i < len(requests):  # an arrival first, on a tie too
                seq = requests[i]
                self._next = i + 1
                self.now = max(self.now, seq.req.time)
                self._arrive(seq)
                continue
            at, _, fn, payload = heapq.heappop(events)
            self.now = max(self.now, at)
            fn(payload)
        return self

    async def _run_on_loop(self) -> None:
        """The trace's arrivals on the event loop's clock, then every request to its end."""
        loop = self.loop
        assert loop is not None
        for worker in self.workers:
            worker.start()
        self.pin()
        for i, seq in enumerate(self.requests):
            self._next = i + 1
            if seq.req.time > loop.time():
                await asyncio.sleep(seq.req.time - loop.time())
            self.now = loop.time()
            self._arrive(seq)
        await asyncio.gather(*(task for w in self.workers for task in w.tasks))
        self.now = loop.time()
        engines = {w.core.task for w in self.workers}
        # what the residencies still do (a restore, a pin), to its end, then the engines stop
        while rest := asyncio.all_tasks() - engines - {asyncio.current_task()}:
            await asyncio.gather(*rest, return_exceptions=True)
        for task in engines:
            task.cancel()
        await asyncio.gather(*engines, return_exceptions=True)

    def views(self) -> list[WorkerView]:
        """The router's views of the workers, polled every `router_poll_s`."""
        if self.now - self._views_at >= self.config.router_poll_s:
            self._views = [w.view() for w in self.workers]
            self._views_at = self.now
        return self._views

    def route(self, seq: SimRequest) -> tuple[int | None, str, tuple[str, ...]]:
        """Its worker (None: no pool open to its tenant serves it), why (`placed`, a pick's) and
        the pick's ranking (the workers it may use)."""
        if self.epp is not None:
            return self.epp.pick(self, seq), "epp", ()
        placed = self.controller.pick(seq.req.model) if self.controller and seq.req.model else None
        if placed is not None:
            return placed, "placed", ()
        if len(self.workers) == 1 and self.pools is None and self.fair is None:
            return 0, "only", ()
        self.views()
        # As the router's fleet does: a worker's requests open (sent, not finished) count in flight
        # beyond those its last polled state counts, and a routed adapter as loading there until
        # the next poll.
        views = [
            replace(v, in_flight=max(0, self.open[i] - v.waiting - v.running), **self._seen(i, seq))
            for i, v in enumerate(self._views)
        ]
        r = seq.req
        if self.pools is not None:
            pick = self.pools.pick(views, r.tenant, r.rank if r.adapter else 0, r.model, r.priority)
            if pick is None or pick.url is None:
                return None, "refused", ()
        else:
            pick = self.picker.pick(views, r.model, r.priority)
        return (int(pick.url.rsplit("-", 1)[1]) if pick.url else 0), pick.reason, pick.ranking

    def _seen(self, i: int, seq: SimRequest) -> dict:
        """What else the router sees of worker i for this request: its capacity and the requests
        open there (with fair share), the share of the prompt's prefix routed there."""
        seen: dict = {"prefix": self.prefixes.score(i, seq.blocks)} if self.prefixes else {}
        if self.fair is not None:
            seen.update(capacity=self.config.max_num_seqs, num_open=self.open[i])
        return seen

    def _arrive(self, seq: SimRequest) -> None:
        """The request at the router: to its worker, to its tenant's queue, or refused."""
        if self.prefixes is not None:
            seq.blocks = self.prefixes.blocks(seq.req, seq.ref.key if seq.ref else None)
        index, reason, ranking = self.route(seq)
        if index is None:
            self.refuse(seq)
        elif self.fair is not None and self.fair.arrives(seq, reason, ranking):
            self.fair.join(seq)
        else:
            self.send(seq, index, reason)

    def send(self, seq: SimRequest, index: int, reason: str) -> None:
        """To worker `index`; as the router's `sent`, its adapter loading there, its blocks held."""
        model = seq.req.model
        if reason not in ("epp", "placed", "only") and model is not None:
            view = self._views[index]
            if model not in view.loading:
                self._views[index] = replace(view, loading=view.loading | {model})
        if self.prefixes is not None:
            self.prefixes.sent(index, seq.blocks)
        self.open[index] += 1
        worker = self.workers[index]
        if self.fair is not None:
            self.fair.opened(seq, index)
        self.registry.request(worker.index, model, self.now)
        worker.arrive(seq)
        if self.controller is not None and model is not None:
            self.controller.record(worker.index, model)

    def refuse(self, seq: SimRequest) -> None:
        """No pool open to its tenant serves it (404), or its tenant's queue is full (429)."""
        seq.tier, seq.worker = "refused", -1
        self.refused += 1

    def done(self, seq: SimRequest) -> None:
        """A request ended on its worker."""
        self.finished += 1
        self.open[seq.worker] -= 1
        if self.fair is not None:
            self.fair.closed(seq)


def simulate(
    trace: list[Request],
    config: SimConfig,
    policy_factory: Callable[[Simulation], object],
    controller: ControllerConfig | None = None,
) -> Simulation:
    return Simulation(trace, config, policy_factory, controller).run()
