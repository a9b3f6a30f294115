"""A simulated worker of the vLLM engine: the real `Residency` on the vLLM backend decides which
adapters vLLM holds, over a modelled vLLM (`SimVllmCore`: its host cache, device slots, pins and
scheduler) and modelled staging (a stage costs the disk read, after the download from the remote
tier), on the simulation's `VirtualLoop`.

The modelled scheduler is vLLM's: waiting requests first come, first served, up to `max_num_seqs`
and the step's token budget, with at most `max_loras` distinct adapters in a batch, the slots that
pinned adapters outside the batch hold left out (loraplex's plugin); an adapter missing from the
device slots is copied in (the least recently used unpinned one goes), at the host-to-device cost.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from loraplex.engines.vllm.slots import vllm_residency
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.router.picker import WorkerView
from loraplex.sim.backend import SimDisk, _label

SimRequest = Any  # the simulator's request (`simulator.SimRequest`, which imports this module)


@dataclass(frozen=True, slots=True)
class SimLora:
    """What a request is handed to vLLM with (vLLM's `LoRARequest`)."""

    key: AdapterKey
    lora_id: int


class _AtSimulatedTime(Executor):
    """Runs `fn(ref)` when its modelled seconds have passed on the loop's clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: Callable[[AdapterRef], float]):
        self.loop, self.seconds = loop, seconds

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as exc:
                future.set_exception(exc)

        self.loop.call_later(self.seconds(*args), run)
        return future


class SimStaging:
    """Staging as the residency sees it: a stage reads the artifact from the worker's disk (after a
    download when the disk does not hold it). Nothing is kept staged beyond the disk tier."""

    def __init__(self, worker: VllmWorker):
        self.worker = worker
        self.executor = _AtSimulatedTime(worker.loop, self._plan)
        self._plans: dict[AdapterKey, tuple[str, dict[str, float]]] = {}

    def _plan(self, ref: AdapterRef) -> float:
        costs, nbytes = self.worker.sim.config.costs, self.worker.sim.nbytes[ref.key]
        stages = {"disk": costs.disk.seconds(nbytes)}
        source = "disk"
        if ref.path is None and not self.worker.disk.has(ref.key.adapter_digest):
            source, stages["download"] = "remote", costs.remote.seconds(nbytes)
        self._plans[ref.key] = (source, stages)
        return sum(stages.values())

    def stage(self, ref: AdapterRef) -> tuple[int, dict[str, float], str | None]:
        source, stages = self._plans.pop(ref.key)
        nbytes = self.worker.sim.nbytes[ref.key]
        if ref.path is None:
            self.worker.disk.use(ref.key.adapter_digest, nbytes)
        self.worker.loads[source] += 1
        self.worker.load_seconds += sum(stages.values())
        return nbytes, stages, f"sim:{nbytes}"  # adapters of one size: one shape vLLM takes

    def has(self, key: AdapterKey) -> bool:
        return False

    def path(self, key: AdapterKey) -> PurePath:
        return PurePath("/sim/staged", key.adapter_digest.removeprefix("sha256:"))

    def is_unchanged(self, key: AdapterKey) -> bool:
        return True

    def reuse(self, key: AdapterKey) -> None:
        """Nothing is kept staged."""

    def unstage(self, key: AdapterKey, nbytes: int) -> None:
        """Nothing is kept staged."""

    def close(self) -> None:
        """Nothing to close."""


class SimRuntime:
    def __init__(self, worker: VllmWorker):
        self.worker = worker

    def staging(self, disk: DiskTier | None, in_use: Callable[[str], bool]) -> SimStaging:
        return SimStaging(self.worker)

    @property
    def engine(self) -> SimVllmCore:
        return self.worker.core

    def request(self, key: AdapterKey, lora_id: int, path: str) -> SimLora:
        return SimLora(key, lora_id)


class _Running:
    __slots__ = ("left", "lora_id", "seq")

    def __init__(self, seq: SimRequest, lora_id: int | None):
        self.seq, self.lora_id, self.left = seq, lora_id, seq.req.output_tokens


class SimVllmCore:
    """vLLM's engine core as the residency drives it (`add_lora`, `remove_lora`, `pin_lora`) and as
    requests run in it."""

    def __init__(self, worker: VllmWorker):
        self.worker = worker
        self.config = worker.sim.config
        self.host: dict[int, int] = {}  # lora id -> bytes, in vLLM's host cache
        self.device: OrderedDict[int, None] = OrderedDict()  # device slots, least recent first
        self.pinned: set[int] = set()
        self.waiting: deque[tuple[_Running, asyncio.Future]] = deque()
        self.running: list[tuple[_Running, asyncio.Future]] = []
        self.copies, self.copy_seconds, self._uncharged = 0, 0.0, 0.0
        self._wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    # -- the adapter calls -------------------------------------------------------------------------
    async def add_lora(self, lora: SimLora) -> bool:
        await asyncio.sleep(0)  # the engine core takes it between two steps
        self.host[lora.lora_id] = self.worker.sim.nbytes[lora.key]
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        await asyncio.sleep(0)
        self.pinned.discard(lora_id)
        self.device.pop(lora_id, None)
        return self.host.pop(lora_id, None) is not None

    async def pin_lora(self, lora_id: int) -> bool:
        await asyncio.sleep(0)
        if lora_id not in self.host:
            return False
        self.pinned.add(lora_id)
        self._into_device(lora_id, set())
        return True

    def _into_device(self, lora_id: int, batch: set[int]) -> None:
        if lora_id in self.device:
            self.device.move_to_end(lora_id)
            return
        if len(self.device) >= self.config.gpu_slots:
            victim = next((i for i in self.device if i not in self.pinned and i not in batch), None)
            if victim is None:
                return  # no slot: the batch rule keeps this from happening
            del self.device[victim]
        self.device[lora_id] = None
        seconds = self.config.costs.h2d.seconds(self.host.get(lora_id, 0))
        self.copies += 1
        self.copy_seconds += seconds
        self._uncharged += seconds

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, seq: SimRequest, lora: SimLora | None) -> None:
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((_Running(seq, None if lora is None else lora.lora_id), done))
        self._wake.set()
        await done

    def _admit(self, now: float) -> list[_Running]:
        """vLLM's scheduler: first come, first served, within the batch's sequences, tokens and
        adapters."""
        c = self.config
        budget = c.max_num_batched_tokens - len(self.running)
        loras = {r.lora_id for r, _ in self.running if r.lora_id is not None}
        admitted, skipped = [], deque()
        while self.waiting and len(self.running) < c.max_num_seqs:
            run, done = self.waiting.popleft()
            lid = run.lora_id
            room = c.gpu_slots - len(self.pinned - loras)
            if run.seq.req.prompt_tokens > budget or (
                lid is not None and lid not in loras and len(loras) >= room
            ):
                skipped.append((run, done))
                continue
            budget -= run.seq.req.prompt_tokens
            if lid is not None:
                loras.add(lid)
            run.seq.admitted_at = now
            self.running.append((run, done))
            admitted.append(run)
        self.waiting.extendleft(reversed(skipped))
        for lid in loras:
            self._into_device(lid, loras)
        self.worker.peak_slots = max(self.worker.peak_slots, len(loras))
        return admitted

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            decodes = len(self.running)
            admitted = self._admit(loop.time())
            if not self.running:  # every waiting request held back: look again at the next change
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = sum(r.seq.req.prompt_tokens for r in admitted)
            adapters = len({r.lora_id for r, _ in self.running if r.lora_id is not None})
            step_s = self.config.service.step_seconds(prefill, decodes, adapters)
            copies, self._uncharged = self._uncharged, 0.0
            await asyncio.sleep(step_s + copies)
            first_end, steps = loop.time(), 1
            if not self.waiting:  # decode-only steps until a finish or an arrival
                steps += await self._quiet_steps(loop, step_s)
            self._advance(steps, loop.time(), set(map(id, admitted)), first_end)

    async def _quiet_steps(self, loop: asyncio.AbstractEventLoop, step_s: float) -> int:
        """Steps that change nothing (no finish, no arrival) taken at once; an arrival cuts them at
        the next step boundary."""
        left = min(r.left for r, _ in self.running) - 1
        if left <= 0 or step_s <= 0:
            return 0
        start = loop.time()
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), left * step_s)
        except TimeoutError:
            return left
        done = math.floor((loop.time() - start) / step_s)
        await asyncio.sleep(start + (done + 1) * step_s - loop.time())
        return min(left, done + 1)

    def _advance(self, steps: int, now: float, admitted: set[int], first_end: float) -> None:
        """`steps` steps ended at `now`, the first at `first_end` (the admitted requests' first
        token)."""
        still = []
        for run, done in self.running:
            if id(run) in admitted:
                run.seq.first_token_at = first_end
            run.left -= steps
            if run.left <= 0:
                run.seq.finish_at = now
                done.set_result(None)
            else:
                still.append((run, done))
        self.running = still


class VllmWorker:
    """One worker of the vLLM engine: the residency and the modelled engine, the router's view."""

    def __init__(self, sim, index: int, policy):
        """`sim`: the `Simulation` it belongs to."""
        from loraplex.settings.serve_values import VLLM_HOST_CACHE_PER_SLOT

        c = sim.config
        self.sim, self.index, self.url = sim, index, f"worker-{index}"
        self.loop = sim.loop
        self.disk = SimDisk(c.disk_bytes)
        self.loads: Counter = Counter()
        self.load_seconds = 0.0
        self.peak_slots = 0
        self.peak_cpu_bytes = 0
        self.core = SimVllmCore(self)
        self.pool = self.core  # its copies into device slots (the report reads them)
        self.cache = vllm_residency(
            SimRuntime(self),
            max_loras=c.gpu_slots,
            max_cpu_loras=c.max_cpu_loras or VLLM_HOST_CACHE_PER_SLOT * c.gpu_slots,
            disk=self.disk,
            policy=policy,
            budgets=c.budgets(),
            scheduler_counts_pins=True,
            clock=self.loop.time,
        )
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.cache.backend.start(self.loop)
        self.core.task = self.loop.create_task(self.core.run())

    def arrive(self, seq: SimRequest) -> None:
        seq.worker = self.index
        if seq.ref is not None:
            # what the server reports on arrival: a local adapter's bytes are on disk already
            tier = self.cache.tier_of(seq.ref.key)
            seq.tier = "disk" if tier == "remote" and seq.ref.path is not None else tier
            self.cache.record_request(seq.ref)
        self.tasks.append(self.loop.create_task(self._serve(seq)))

    async def _serve(self, seq: SimRequest) -> None:
        lora = None
        if seq.ref is not None:
            lora = await self.cache.acquire(seq.ref)
            self.sim.admitted(seq)
        try:
            await self.core.generate(seq, lora)
        finally:
            if seq.ref is not None:
                self.cache.release(seq.ref.key, seq.ref.tenant)
            self.sim.done(seq)
        self.peak_cpu_bytes = max(self.peak_cpu_bytes, sum(self.core.host.values()))

    def view(self) -> WorkerView:
        cache, core = self.cache, self.core
        running = [r for r, _ in core.running]
        return WorkerView(
            self.url,
            waiting=len(core.waiting),
            running=len(running),
            active_tokens=sum(r.seq.req.prompt_tokens + r.seq.req.output_tokens for r in running),
            recent_evictions=cache.ledger.num_recent_evictions(self.loop.time()),
            free_slots=cache.tiers.free_slots(),
            gpu=frozenset(map(_label, cache.tiers.in_slots())),
            cpu=frozenset(map(_label, cache.tiers.in_host())),
            loading=frozenset(map(_label, cache.loading)),
        )
