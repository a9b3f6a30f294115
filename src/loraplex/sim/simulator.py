"""Discrete-event simulation of workers running the real adapter cache, policies and router picker.

Nothing of the cache is re-implemented: each simulated worker owns a real `AdapterCache` whose clock
is the simulation's, whose slot pool records host-to-device copies instead of moving tensors, whose
executor is this event loop (a load's future completes at its simulated finish time) and whose
loader models the disk and remote tiers by bandwidth and fixed latency. A worker's step is the
engine's: the running requests decode one token each, then waiting requests are admitted by the
scheduler's own rule (`loraplex.engines.native.admission.admit_waiting`), and a request holds its
adapter's slot until it finishes.
"""

from __future__ import annotations

import heapq
import json
import math
import operator
import random
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from loraplex.engines.native.admission import Take, admit_waiting
from loraplex.engines.native.cache import AdapterCache, Loaded
from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.router.picker import Picker, WorkerView
from loraplex.sim.registry_load import RegistryLoad, registry_changes
from loraplex.sim.workload import Request

# Llama-2-7B (hidden 4096, intermediate 11008, 32 layers), LoRA on all seven linear modules,
# bfloat16: 2 bytes × 32 layers × (4 × (4096 + 4096) + 3 × (4096 + 11008)) per unit of rank.
LLAMA7B_BYTES_PER_RANK = 2 * 32 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
TIERS = ("gpu", "cpu", "disk", "remote")


# -- cost models -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierCost:
    latency_s: float
    """Fixed cost of one transfer."""
    bandwidth: float
    """Bytes per second."""

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class LoadCosts:
    """What bringing an adapter up one tier costs: remote → disk (download), disk → cpu (read,
    digest check, pack), cpu → gpu (host-to-device copy into a slot)."""

    remote: TierCost = TierCost(0.050, 200e6)
    disk: TierCost = TierCost(0.005, 2e9)
    h2d: TierCost = TierCost(0.0005, 12e9)
    source: str = "defaults"

    def to_dict(self) -> dict:
        return {
            **{
                t: {"latency_s": c.latency_s, "bandwidth_bytes_per_s": c.bandwidth}
                for t, c in (("remote", self.remote), ("disk", self.disk), ("h2d", self.h2d))
            },
            "source": self.source,
        }


@dataclass(frozen=True)
class ServiceModel:
    """Seconds of one engine step: a fixed part (reading the weights), per decoding sequence, per
    prefill token, and per distinct adapter in the batch (the grouped LoRA kernels), plus any
    host-to-device copies the step made.

    Defaults are a 7B model in bfloat16 on one data-center GPU: ~10 ms per decode step at small
    batch, ~16k prefill tokens/s, and a small per-adapter cost."""

    step_s: float = 0.010
    per_decode_s: float = 1.2e-4
    per_prefill_token_s: float = 6e-5
    per_adapter_s: float = 3e-4
    source: str = "defaults"

    def step_seconds(self, prefill_tokens: int, decodes: int, adapters: int) -> float:
        return (
            self.step_s
            + self.per_decode_s * decodes
            + self.per_prefill_token_s * prefill_tokens
            + self.per_adapter_s * adapters
        )

    @classmethod
    def from_engine_throughput(cls, path: str | Path) -> ServiceModel:
        """Calibrate from `bench/engine_throughput.py` JSON: the base-only row's time per output
        token gives the step cost, its total time the prefill cost, and the many-adapter row the
        per-adapter cost."""
        data = json.loads(Path(path).read_text())
        rows = {
            r["workload"]["num_adapters"]: r
            for r in data["rows"]
            if r.get("workload", {}).get("lora_bytes_per_step") is None
        }
        base = rows[0]
        w = base["workload"]
        tpot = base["ours"]["tpot_by_rank_s"]["base"]
        batch = min(w["num_requests"], 64)
        decode_total = tpot * (w["output_len"] - 1) * math.ceil(w["num_requests"] / batch)
        prefill_total = max(0.0, base["ours"]["seconds"] - decode_total)
        per_prefill = prefill_total / (w["num_requests"] * w["prompt_len"])
        many = max(rows)
        per_adapter = 0.0
        if many > 0:
            tpots = rows[many]["ours"]["tpot_by_rank_s"].values()
            per_adapter = max(0.0, (sum(tpots) / len(tpots) - tpot) / min(many, batch))
        return cls(
            step_s=tpot,
            per_decode_s=0.0,
            per_prefill_token_s=per_prefill,
            per_adapter_s=per_adapter,
            source=str(path),
        )


@dataclass(frozen=True)
class SimConfig:
    gpu_slots: int = 8
    cpu_bytes: int = 4 * 2**30
    max_cpu_loras: int | None = None
    disk_bytes: int | None = None
    """None: an artifact once fetched stays on the worker's disk."""
    local_adapters: bool = False
    """True: every adapter is a local directory (as with --lora-modules), so there is no remote
    tier."""
    workers: int = 1
    router: str = "affinity"
    router_poll_s: float = 0.25
    """How old the router's view of each worker may be (it polls /admin/state)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    tenant_budgets: dict[str, Budget] | None = None
    """Residency budgets per tenant (`loraplex.residency.budgets`), as the registry keeps them."""
    tenant_gpu_share: float = 1.0
    tenant_cpu_share: float = 1.0
    """The default budget of a tenant without its own, as `serve
    --tenant-gpu-share/--tenant-cpu-share`."""
    bytes_per_rank: int = LLAMA7B_BYTES_PER_RANK
    """An adapter's host-copy bytes are its rank times this, unless `adapter_bytes` names it."""
    adapter_bytes: dict[str, int] | None = None
    """Bytes per `name@revision`, overriding the rank rule (e.g. measured packed sizes)."""
    service: ServiceModel = field(default_factory=ServiceModel)
    costs: LoadCosts = field(default_factory=LoadCosts)
    skip_blocked: bool = True
    """Do not call the cache's acquire when it can only fail, the adapter loading or every slot held
    (same results, faster)."""
    skip_quiet_steps: bool = True
    """End at once the steps that can change nothing: no arrival at the worker, none of its loads or
    finishes before they end and no waiting request that could be admitted (same results,
    faster)."""
    idle_poll_s: float = 0.01
    """A worker whose waiting requests found no slot and has nothing running or loading tries again
    after this."""
    seed: int = 0
    registry_changes_per_s: float = 0.0
    """Registry changes per second (`loraplex.sim.registry_load`): notified to every worker, each
    worker's next request for the changed adapter resolves it again."""

    def __post_init__(self):
        if self.gpu_slots < 1 or self.workers < 1 or self.cpu_bytes < 0:
            raise ValueError("gpu_slots and workers must be at least 1, cpu_bytes non-negative")
        self.budgets()  # refuses a share outside [0, 1]

    def budgets(self) -> TenantBudgets:
        """The budgets on this capacity: one beyond it is capped at it (a sizing sweep runs smaller
        caches)."""
        capped = {
            t: Budget(
                None if b.gpu_slots is None else min(b.gpu_slots, self.gpu_slots),
                None if b.cpu_bytes is None else min(b.cpu_bytes, self.cpu_bytes),
            )
            for t, b in (self.tenant_budgets or {}).items()
        }
        return TenantBudgets(
            self.gpu_slots, self.cpu_bytes, capped, self.tenant_gpu_share, self.tenant_cpu_share
        )


# -- the simulated device and tiers ----------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SimKey(AdapterKey):
    """An AdapterKey compared by identity: the simulation makes exactly one key object per adapter
    revision, and the cache compares and hashes keys millions of times (slot lists, dicts)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __post_init__(self):
        # the router's views name keys on every poll
        object.__setattr__(self, "_label", super().__str__())

    def __str__(self) -> str:
        return self._label


_label = operator.attrgetter("_label")  # str() of SimKeys without a Python call per key


@dataclass(frozen=True, slots=True)
class SimPacked:
    """A host copy as the cache sees it: only its size matters."""

    nbytes: int


class SimPool:
    """The slot pool: a slot write costs a host-to-device copy, charged to the worker's current
    step."""

    def __init__(self, num_slots: int, h2d: TierCost):
        self.num_slots = num_slots
        self.h2d = h2d
        self.contents: list[SimPacked | None] = [None] * num_slots
        self.uncharged_s = 0.0
        self.copies = 0
        self.copy_seconds = 0.0

    def set_slot(self, slot: int, packed: SimPacked) -> float:
        seconds = self.h2d.seconds(packed.nbytes)
        self.contents[slot] = packed
        self.uncharged_s += seconds
        self.copies += 1
        self.copy_seconds += seconds
        return seconds

    def clear_slot(self, slot: int) -> None:
        self.contents[slot] = None

    def take_uncharged(self) -> float:
        seconds, self.uncharged_s = self.uncharged_s, 0.0
        return seconds


class SimDisk:
    """The worker's artifact cache: least recently used artifacts go when over budget (as
    `cache.disk`)."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        self.sizes: dict[str, int] = {}  # digest -> bytes, least recently used first
        self.used = 0
        self.peak = 0

    def has(self, digest: str) -> bool:
        return digest in self.sizes

    def use(self, digest: str, nbytes: int) -> None:
        if digest in self.sizes:
            self.sizes[digest] = self.sizes.pop(digest)
            return
        self.sizes[digest] = nbytes
        self.used += nbytes
        while self.max_bytes is not None and self.used > self.max_bytes and len(self.sizes) > 1:
            oldest = next(iter(self.sizes))
            self.used -= self.sizes.pop(oldest)
        self.peak = max(self.peak, self.used)

    def close(self) -> None:
        """What `AdapterCache.close` calls on its disk tier: a simulated one holds no connection or
        file."""


# -- requests and workers --------------------------------------------------------------------------
class SimRequest:
    __slots__ = (
        "admitted_at",
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


class Worker:
    def __init__(self, sim: Simulation, index: int, policy):
        c = sim.config
        self.sim, self.index = sim, index
        self.url = f"worker-{index}"
        self.pool = SimPool(c.gpu_slots, c.costs.h2d)
        self.disk = SimDisk(c.disk_bytes)
        self.cache = AdapterCache(
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
        self.step_index = 0
        self.steps_in_flight = 1  # engine steps the scheduled step end stands for
        self.end_token = 0  # the scheduled step end that counts (an arrival may move it earlier)
        self.quiet: tuple[float, float, list[AdapterKey]] | None = (
            None  # (first end, step seconds, blocked keys)
        )
        self.touch: tuple[list[AdapterKey], float] | None = (
            None  # blocked keys and when the last step touches them
        )
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
            self.cache.add_waiting(seq.ref.key)
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
            took = cache.num_loading()
            cache.poll()
            if cache.num_loading() != took:
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
        prefill_tokens = sum(seq.req.prompt_tokens for seq in admitted)
        copies = self.pool.take_uncharged()
        if admitted:
            self.peak_slots = max(self.peak_slots, self.pool.num_slots - cache.free_slots())
        if not decodes and not admitted:
            self.busy = False
            if self.waiting and not cache.num_loading() and not self.retry_scheduled:
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
        if not cache.budget_waiting:
            return waiting
        held = {id(s) for s in waiting if s.ref is not None and cache.defers(s.ref)}
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
            cache.record_wait(ref.key, now)  # what the failed acquire would have recorded
            return Take.BLOCKED
        if cache.acquire(ref) is not None:
            return Take.TAKEN
        return Take.BLOCKED if cache.is_loading(ref.key) else Take.REFUSED

    def _admit(self, seq: SimRequest, now: float) -> None:
        self.waiting.remove(seq)
        seq.admitted_at = now
        self.num_running += 1
        self.running_tokens += seq.req.prompt_tokens + seq.req.output_tokens
        if seq.ref is not None:
            self.cache.drop_waiting(seq.ref.key)
            self.running_adapters[seq.ref.key] += 1
            self.sim.admitted(seq)

    def _acquire_can_only_fail(self, key: AdapterKey) -> bool:
        """The adapter is loading, or in host memory while every slot is held by running requests
        (the cache would rank every adapter only to find no victim)."""
        cache = self.cache
        if cache.in_slot(key):
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
            self.cache.touch_waiting(keys, last)
        now = self.sim.now
        self.step_index += self.steps_in_flight
        for seq in self.prefilled:
            seq.first_token_at = now
            heapq.heappush(
                self.finishing, (self.step_index + seq.req.output_tokens - 1, id(seq), seq)
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
        self.sim.finished += 1

    def _check_capacity(self) -> None:
        self.peak_cpu_bytes = max(self.peak_cpu_bytes, self.cache.cpu_bytes_used)

    def view(self) -> WorkerView:
        """What the router polls from the worker's /admin/state."""
        cache = self.cache
        return WorkerView(
            self.url,
            waiting=len(self.waiting),
            running=self.num_running,
            active_tokens=self.running_tokens,
            recent_evictions=cache.num_recent_evictions(self.sim.now),
            free_slots=cache.free_slots(),
            gpu=frozenset(map(_label, cache.resident("gpu"))),
            cpu=frozenset(map(_label, cache.resident("cpu"))),
            loading=frozenset(map(_label, cache.loading_keys())),
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
    ):
        self.trace, self.config = trace, config
        self.now = 0.0
        self._next = 0  # the next request to arrive
        self._events: list = []
        self._order = 0
        self.finished = 0
        self.refs: dict[str, AdapterRef] = {}
        self.nbytes: dict[AdapterKey, int] = {}
        self.requests = [self._request(r) for r in trace]
        self._arrivals: dict[AdapterKey, list[float]] = {}
        for seq in self.requests:
            if seq.ref is not None:
                self._arrivals.setdefault(seq.ref.key, []).append(seq.req.time)
        self._admitted: Counter = Counter()
        self.workers = [Worker(self, i, policy_factory(self)) for i in range(config.workers)]
        self.picker = Picker(config.router, rng=random.Random(config.seed))
        self._views: list[WorkerView] = []
        self._views_at = -math.inf
        self.span_s = trace[-1].time if trace else 0.0
        changes = registry_changes(trace, config.registry_changes_per_s, config.seed)
        self.registry = RegistryLoad(config.workers, changes, half_at=self.span_s / 2)

    def clock(self) -> float:
        return self.now

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

    def run(self) -> Simulation:
        requests, events = self.requests, self._events
        while self._next < len(requests) or events:
            i = self._next
            next_arrival = requests[i].req.time if i < len(requests) else math.inf
            next_event = events[0][0] if events else math.inf
            if next_arrival <= next_event and i < len(requests):  # an arrival first, on a tie too
                seq = requests[i]
                self._next = i + 1
                self.now = max(self.now, seq.req.time)
                worker = self._route(seq)
                self.registry.request(worker.index, seq.req.model, self.now)
                worker.arrive(seq)
                continue
            at, _, fn, payload = heapq.heappop(events)
            self.now = max(self.now, at)
            fn(payload)
        return self

    def _route(self, seq: SimRequest) -> Worker:
        if len(self.workers) == 1:
            return self.workers[0]
        if self.now - self._views_at >= self.config.router_poll_s:
            self._views = [w.view() for w in self.workers]  # each with in_flight 0
            self._views_at = self.now
        pick = self.picker.pick(self._views, seq.req.model, seq.req.priority)
        index = int(pick.url.rsplit("-", 1)[1]) if pick.url else 0
        view, model = self._views[index], seq.req.model
        # As the router's fleet does: a routed request counts in flight, and its adapter as loading
        # there, until the next poll.
        loading = view.loading if model is None or model in view.loading else view.loading | {model}
        self._views[index] = replace(view, in_flight=view.in_flight + 1, loading=loading)
        return self.workers[index]


# -- results ---------------------------------------------------------------------------------------
def _percentiles(values) -> dict[str, float | None]:
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(a):
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def hot_adapters(trace: list[Request], count: int, floor: float = 0.05) -> set[str]:
    """The `count` most requested adapters (name@revision) of a trace, leaving out those with fewer
    than `floor` of the top one's requests (a one-off is not hot however many slots there are)."""
    ranked = Counter(r.model for r in trace if r.adapter is not None).most_common(count)
    return {m for m, n in ranked if ranked and n >= max(2, floor * ranked[0][1])}


def summarize(sim: Simulation, hot: set[str] | None = None) -> dict:
    """Hit rates per tier, byte hit rate, reloads after eviction, thrash ratio, miss cost, admission
    wait, TTFT / TPOT percentiles (all, warm, cold, per tier, hot adapters) and per-tenant
    figures."""
    seqs = [s for s in sim.requests if s.ref is not None]
    n = len(seqs) or 1
    tiers = Counter(s.tier for s in seqs)
    total_bytes = sum(s.nbytes for s in seqs) or 1
    caches = [w.cache for w in sim.workers]
    evictions = sum(c.num_evictions for c in caches)
    reloads = sum(c.reloads_after_eviction for c in caches)
    h2d = sum(w.pool.copy_seconds for w in sim.workers)
    loads = sum(w.load_seconds for w in sim.workers)
    hot = (
        hot
        if hot is not None
        else hot_adapters(sim.trace, sim.config.gpu_slots * sim.config.workers)
    )

    by_tenant: dict[str, list[SimRequest]] = {}
    for s in sim.requests:
        by_tenant.setdefault(s.req.tenant, []).append(s)
    makespan = max((s.finish_at for s in sim.requests), default=0.0)
    return {
        "requests": len(sim.requests),
        "finished": sim.finished,
        "hit_rate": {t: tiers[t] / n for t in TIERS},
        "byte_hit_rate": {
            "gpu": sum(s.nbytes for s in seqs if s.tier == "gpu") / total_bytes,
            "gpu+cpu": sum(s.nbytes for s in seqs if s.tier in ("gpu", "cpu")) / total_bytes,
        },
        "cold_start_rate": (tiers["disk"] + tiers["remote"]) / n,
        "registry": sim.registry.figures(len(sim.requests), sim.span_s),
        "miss_cost": h2d + loads,
        "miss_cost_parts": {"h2d": h2d, "load": loads},
        "activations": sum(w.pool.copies for w in sim.workers),
        "loads": dict(sum((w.loads for w in sim.workers), Counter())),
        "evictions": evictions,
        "reloads_after_eviction": reloads,
        "thrash_ratio": reloads / evictions if evictions else 0.0,
        "latency": {
            "all": _latency(sim.requests),
            "warm": _latency([s for s in sim.requests if s.tier in ("gpu", "cpu")]),
            "cold": _latency([s for s in sim.requests if s.tier in ("disk", "remote")]),
            **{f"tier_{t}": _latency([s for s in sim.requests if s.tier == t]) for t in TIERS},
            "hot": _latency([s for s in seqs if s.req.model in hot]),
        },
        "tenants": {t: _tenant_figures(g, caches) for t, g in sorted(by_tenant.items())},
        "peak": {
            "slots": max(w.peak_slots for w in sim.workers),
            "cpu_bytes": max(w.peak_cpu_bytes for w in sim.workers),
            "disk_bytes": max(w.disk.peak for w in sim.workers),
        },
        "simulated_s": makespan,
    }


def _latency(group: list[SimRequest]) -> dict:
    """TTFT, TPOT and admission wait percentiles of a group of requests."""
    ttft = [s.first_token_at - s.req.time for s in group]
    tpot = [
        (s.finish_at - s.first_token_at) / (s.req.output_tokens - 1)
        for s in group
        if s.req.output_tokens > 1
    ]
    wait = [s.admitted_at - s.req.time for s in group]
    return {
        "count": len(group),
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
        "queue_wait_s": _percentiles(wait),
    }


def _tenant_figures(group: list[SimRequest], caches) -> dict:
    """One tenant's requests, budget waits, hit and cold start rates, and latencies."""
    # Rates over the tenant's adapter requests, as the run's: a base-model request has no
    # adapter to miss.
    adapter = [s for s in group if s.ref is not None]
    m = len(adapter) or 1
    name = group[0].req.tenant if group else None
    budget_waits = sum(c.budget_waits.get(name, 0) for c in caches)
    return {
        "requests": len(group),
        "adapter_requests": len(adapter),
        "budget_waits": budget_waits,
        "gpu_hit_rate": sum(s.tier == "gpu" for s in adapter) / m,
        "cold_start_rate": sum(s.tier in ("disk", "remote") for s in adapter) / m,
        **_latency(group),
    }


def simulate(
    trace: list[Request], config: SimConfig, policy_factory: Callable[[Simulation], object]
) -> Simulation:
    return Simulation(trace, config, policy_factory).run()


def config_dict(config: SimConfig) -> dict:
    out = asdict(config)
    out["service"] = asdict(config.service)
    out["costs"] = config.costs.to_dict()
    return out


# -- comparing policies ----------------------------------------------------------------------------
"""Runtime policies (lru, score), baselines (lfu, gdsf) and a0, the popularity oracle (a reference,
not a policy)."""


def policy_factory(name: str) -> Callable[[Simulation], object]:
    """A new policy per worker cache: the runtime ones (lru, score), the baselines (lfu, gdsf), or
    the oracles (`a0`: true popularity; `optimal`: farthest next use)."""
    from loraplex.residency.policy import GDSFPolicy, LFUPolicy, make_policy
    from loraplex.sim.optimal import OraclePolicy, PopularityOracle

    if name == "optimal":
        return lambda sim: OraclePolicy(sim.next_use)
    if name == "a0":
        return lambda sim: PopularityOracle(sim.request_counts())
    if name == "lfu":
        return lambda sim: LFUPolicy()
    if name == "gdsf":
        return lambda sim: GDSFPolicy()
    make_policy(name)  # refuses an unknown name now
    return lambda sim: make_policy(name)


def bound(sim: Simulation, admitted: bool = False) -> dict:
    """The optimum's lower bound for this trace and configuration (capacities pooled over workers),
    over the requests in arrival order, or with `admitted` in the order the run admitted them."""
    from loraplex.sim.optimal import lower_bound

    c = sim.config
    requests = [s for s in sim.requests if s.ref is not None]
    if admitted:  # stable: requests admitted in one step keep their arrival order
        requests.sort(key=lambda s: (math.isnan(s.admitted_at), s.admitted_at))
    seq = [s.ref.key for s in requests]
    if not seq:
        return {"miss_cost": 0.0, "parts": {}, "gpu_misses_min": 0, "gpu_hit_rate_max": 1.0}
    return lower_bound(
        seq,
        sim.nbytes,
        gpu_slots=c.gpu_slots * c.workers,
        cpu_bytes=c.cpu_bytes * c.workers,
        max_cpu_loras=None if c.max_cpu_loras is None else c.max_cpu_loras * c.workers,
        disk_bytes=None if c.disk_bytes is None else c.disk_bytes * c.workers,
        local=c.local_adapters,
        costs=c.costs,
    )


def compare(
    trace: list[Request],
    config: SimConfig,
    policies: list[str],
    hot: set[str] | None = None,
    on_run: Callable[[str], None] = lambda name: None,
    optimal: bool = True,
) -> dict[str, dict]:
    """One entry per policy plus "optimal": the lower bound's miss cost, with the latencies and hit
    rates of a farthest-next-use oracle run; each policy's entry carries its gap to both. Without
    `optimal`, the policies alone (their gaps None)."""
    import time

    hot = hot if hot is not None else hot_adapters(trace, config.gpu_slots * config.workers)
    entries, sims = {}, {}
    for name in [*policies, "optimal"] if optimal else policies:
        start, start_cpu = time.perf_counter(), time.process_time()
        sim = sims[name] = simulate(trace, config, policy_factory(name))
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        entries[name] = summarize(sim, hot)
        entries[name]["wall_s"], entries[name]["cpu_s"] = wall, cpu
        entries[name]["requests_per_wall_s"] = len(trace) / wall if wall > 0 else math.inf
        entries[name]["requests_per_cpu_s"] = len(trace) / cpu if cpu > 0 else math.inf
        if name == "optimal":
            lb = bound(sim)
            oracle = entries[name]
            oracle["miss_cost_oracle"] = oracle["miss_cost"]
            oracle["miss_cost"] = lb["miss_cost"]
            oracle["lower_bound"] = lb
        on_run(name)
    if optimal:
        _gaps_to_optimum(entries, sims)
    else:
        for entry in entries.values():
            entry["gap"] = entry["gap_oracle"] = None
    return entries


def _gaps_to_optimum(entries: dict[str, dict], sims: dict[str, Simulation]) -> None:
    """Each entry's gap to the optimum's bound and to the oracle run."""
    from loraplex.sim.optimal import gap

    least = min(e.get("miss_cost_oracle", e["miss_cost"]) for e in entries.values())
    if least < entries["optimal"]["miss_cost"]:
        # A run paid less than the bound on the arrival order allows: waiting requests of one
        # adapter were admitted together, with one load. Each run's cost is at least the bound on
        # the order it admitted; the least of those holds for every run.
        lb = min((bound(sim, admitted=True) for sim in sims.values()), key=lambda b: b["miss_cost"])
        if lb["miss_cost"] < entries["optimal"]["miss_cost"]:
            entries["optimal"]["miss_cost"] = lb["miss_cost"]
            entries["optimal"]["lower_bound"] = {**lb, "order": "admission"}
    optimum, oracle = entries["optimal"]["miss_cost"], entries["optimal"]["miss_cost_oracle"]
    for entry in entries.values():
        entry["gap"] = gap(entry["miss_cost"], optimum)
        entry["gap_oracle"] = gap(entry.get("miss_cost_oracle", entry["miss_cost"]), oracle)
