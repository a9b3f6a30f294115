"""The engine in a process of its own, as vLLM's engine core: the model, the cache, the scheduler
and the step loop, so that HTTP, tokenization and the step loop do not share one GIL. `EngineClient`
(client.py) starts it with multiprocessing's spawn and speaks to it over two Unix sockets
(channel.py), in messages encoded by wire.py.

Channels (the client listens, this process connects):
- engine: to this process, lists of messages, each `["add", request_id, prompt_ids, params,
  adapter, counted]`, `["abort", id]` or `["stop"]` (the API server sends those of one turn of its
  event loop together); from it, `["ready", info]` or `["failed", exception]` once, then
  `["step", snapshot | None, outputs, events]`, the outputs as `wire.rows`.
- rpc: `[method, args]` → `[ok, result or exception, snapshot]`, the adapter operations and the
  figures; served on a thread of their own, as the API server's threads call the cache in the same
  process.

A snapshot is `[seq, slots, residency]`: what the server reads on every request without asking.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import select
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.engines.contract import Residency, ResidencySnapshot
from loraplex.engines.native import wire
from loraplex.engines.native.channel import Channel
from loraplex.engines.native.kv_budget import KVBudget
from loraplex.engines.native.sequence import RequestOutput
from loraplex.residency.budgets import TenantBudgets

log = logging.getLogger(__name__)

CACHE_OPS = frozenset(
    {
        "pin",
        "unpin",
        "restore_pin",
        "prewarm",
        "evict",
        "forget",
        "set_budgets",
        "budget_state",
        "state",
    }
)
"""The cache's operations the server may call across the boundary."""
IDLE_POLL_MS = 10
"""How long an idle loop waits for a message: also how soon a load's events go out on an idle
engine."""


def run_engine(config, policy, addresses: dict[str, str], parent_pid: int) -> None:
    """The engine process's entry point."""
    # A signal to the process group (Ctrl-C, a service manager's stop) is the API server's to
    # handle: it drains its requests, then stops this process; this process ends by itself if that
    # one dies.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if "OMP_NUM_THREADS" not in os.environ:
        torch_threads()
    channel = Channel.connect(addresses["engine"])
    try:
        from loraplex.engines.native.llm_engine import LLMEngine

        engine = LLMEngine(config, policy)
    except BaseException as exc:  # the server reports it as it would an in-process failure
        channel.send(wire.encode(["failed", exc]), lambda: os.getppid() == parent_pid)
        channel.close()
        return
    # The model and its libraries live as long as the process: out of the collector's full
    # collections, which would otherwise stop the step loop for a third of a second each.
    gc.collect()
    gc.freeze()
    core = EngineCore(engine, channel, addresses["rpc"], parent_pid)
    try:
        core.run()
    finally:
        core.close()


def torch_threads() -> None:
    """The cores this process may use, less one for the API server: torch's threads wait for each
    other by spinning, so one more thread than there are free cores slows every step (on two cores,
    a 1-token request took 90 ms against 10 ms with one thread)."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))


@dataclass
class EngineInfo:
    """What the engine process tells the API server once it is ready."""

    max_model_len: int
    base_model_digest: str
    num_slots: int
    cpu_bytes: int
    budgets: TenantBudgets
    kv_budget: KVBudget
    num_kv_tokens: int
    eos_ids: tuple[int, ...]
    snapshot: ResidencySnapshot


class EngineCore:
    def __init__(self, engine, channel: Channel, rpc_address: str, parent_pid: int):
        self.engine = engine
        self.cache = engine.adapters
        self.channel = channel
        self.parent_pid = parent_pid
        self._received: collections.deque = collections.deque()  # read while a send waited
        # A load that lands wakes the loop through this pipe (its futures end on loader threads).
        self._woken, self._waker = os.pipe()
        os.set_blocking(self._woken, False)
        os.set_blocking(self._waker, False)
        self._waker_lock = threading.Lock()
        self._waker_open = True
        self._watched: set = set()  # the load futures that wake the loop when they end
        self._poller = select.poll()
        self._poller.register(channel.fileno(), select.POLLIN)
        self._poller.register(self._woken, select.POLLIN)
        self.stopping = False
        self._events: collections.deque = collections.deque()
        self.cache.on_event = self._events.append
        self._snapshot_lock = threading.Lock()
        self._seq = 0
        self._fingerprint = None
        # Grammars compile off the loop (they can take a while); aborts that arrive meanwhile wait.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiled: collections.deque = collections.deque()
        self._compiling: set[str] = set()
        self._aborted: set[str] = set()
        rpc = Channel.connect(rpc_address)  # before "ready": the client accepts it then
        self._rpc = threading.Thread(
            target=self._serve_rpc, args=(rpc,), name="engine-rpc", daemon=True
        )
        self._rpc.start()
        self._send(["ready", self.info()])

    def info(self) -> EngineInfo:
        e, cache = self.engine, self.cache
        return EngineInfo(
            max_model_len=e.max_model_len,
            base_model_digest=e.base_model_digest,
            num_slots=cache.tiers.num_slots,
            cpu_bytes=cache.tiers.cpu_bytes,
            budgets=cache.budgets,
            kv_budget=e.kv_budget,
            num_kv_tokens=e.blocks.num_blocks * e.config.block_size,
            eos_ids=e.eos_ids,
            snapshot=self.snapshot(),
        )

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            self._take_messages(IDLE_POLL_MS if not engine.has_work() else 0)
            self._take_compiled()
            outputs = []
            if engine.has_work():
                try:
                    outputs = engine.step(halve_bursts=True)
                except Exception as exc:  # a bug: fail what is in flight rather than hang clients
                    log.exception("engine step failed")
                    outputs = engine.fail_all(exc)
            events = [self._events.popleft() for _ in range(len(self._events))]
            snapshot = self._snapshot_if_changed(bool(events))
            if outputs or events or snapshot is not None:
                self._send(["step", snapshot, wire.rows(outputs), events])
            if not engine.scheduler.running and engine.adapters.loading:
                self._wait_for_a_load()
            if not self._server_lives():
                log.error("the API server process has exited; the engine stops")
                self.stopping = True

    def _server_lives(self) -> bool:
        return os.getppid() == self.parent_pid and not self.channel.at_eof

    def _send(self, message: list) -> None:
        """To the API server; what it sends meanwhile is kept (`_read_ahead`), so that neither
        side waits for room while the other waits for it."""
        self.channel.send(wire.encode(message), self._server_lives, self._read_ahead)

    def _read_ahead(self) -> None:
        self._received.extend(self.channel.receive())

    def _wait_for_a_load(self) -> None:
        """Every request waits on a load: wait until one lands or a message comes, at most
        IDLE_POLL_MS (a request that time alone may admit is looked at again then)."""
        for future in list(self.cache.loading.values()):
            with self._waker_lock:
                new = future not in self._watched
                self._watched.add(future)
            if new:  # outside the lock: a future that has ended calls back at once
                future.add_done_callback(self._wake_up)
        self._wait(IDLE_POLL_MS)

    def _wait(self, timeout_ms: int) -> None:
        """Until a message or a load's wake-up comes, at most `timeout_ms`."""
        if self._received or not self._poller.poll(timeout_ms):
            return
        try:
            while os.read(self._woken, 4096):
                pass
        except BlockingIOError:
            pass

    def _wake_up(self, future) -> None:
        with self._waker_lock:
            self._watched.discard(future)
            if not self._waker_open:  # a load that ends after the engine stopped
                return
            try:
                os.write(self._waker, b"\0")
            except BlockingIOError:  # wake-ups not read yet: the loop wakes anyway
                pass

    def _take_messages(self, timeout_ms: int) -> None:
        if timeout_ms:
            self._wait(timeout_ms)
        self._received.extend(self.channel.receive())
        while self._received:
            messages = wire.decode(self._received.popleft())
            for message in messages:
                kind = message[0]
                if kind == "add":
                    self._add(*message[1:])
                elif kind == "abort":
                    self._abort(message[1])
                elif kind == "stop":
                    self.stopping = True
                    return
        if self.channel.at_eof:  # the API server closed its end
            self.stopping = True

    def _add(self, request_id, prompt_ids, params, adapter, counted) -> None:
        if params.structured is not None:
            self._compiling.add(request_id)
            future = self._compiler.submit(self.engine.grammars.matcher, params.structured)
            args = (request_id, prompt_ids, params, adapter, counted)
            future.add_done_callback(lambda f: self._compiled.append((args, f)))
            return
        self._add_now(request_id, prompt_ids, params, adapter, counted, None)

    def _take_compiled(self) -> None:
        while self._compiled:
            args, future = self._compiled.popleft()
            request_id = args[0]
            self._compiling.discard(request_id)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                continue
            error = future.exception()
            if error is not None:
                self._fail(request_id, error)
            else:
                self._add_now(*args, future.result())

    def _add_now(self, request_id, prompt_ids, params, adapter, counted, matcher) -> None:
        try:
            self.engine.add_request(prompt_ids, params, adapter, request_id, counted, matcher)
        except Exception as exc:  # a request the engine refuses: its client gets the error
            self._fail(request_id, exc)

    def _fail(self, request_id: str, error: Exception) -> None:
        out = RequestOutput(request_id, [], "", [], True, None, 0, 0, error)
        self._send(["step", None, wire.rows([out]), []])

    def _abort(self, request_id: str) -> None:
        if request_id in self._compiling:
            self._aborted.add(request_id)
        else:
            self.engine.abort(request_id)

    # -- what the server reads ---------------------------------------------------------------------
    def snapshot(self) -> ResidencySnapshot:
        """Every adapter the cache knows, numbered so that the server keeps the newest of those
        the two sockets bring."""
        cache = self.cache
        with self._snapshot_lock:
            self._seq += 1
            residency = {
                key: Residency(
                    tier=cache.tier_of(key),
                    pinned=cache.pinned(key),
                    loading=cache.is_loading(key),
                    in_host_memory=cache.in_host_memory(key),
                    in_use=entry.refcount > 0,
                )
                for key, entry in list(cache.entries.items())
            }
            return ResidencySnapshot(self._seq, list(cache.tiers.slots), residency)

    def _snapshot_if_changed(self, had_events: bool) -> ResidencySnapshot | None:
        """A new snapshot when the slots, the host copies, the loads or the slots' use moved (or a
        cache event came): pins move only by operations, whose replies carry one. Only an adapter
        in a slot is in use, so the slots' use covers every adapter's."""
        cache = self.cache
        entries = cache.entries
        in_use = tuple(bool((e := entries.get(k)) and e.refcount) for k in list(cache.tiers.slots))
        fingerprint = (tuple(cache.tiers.slots), in_use, len(cache.tiers.cpu), len(cache.loading))
        if fingerprint == self._fingerprint and not had_events:
            return None
        self._fingerprint = fingerprint
        return self.snapshot()

    def _serve_rpc(self, rpc: Channel) -> None:
        try:
            while not self.stopping and not rpc.at_eof:
                if not rpc.wait(0.1):
                    continue
                for request in rpc.receive():
                    method, args = wire.decode(request)
                    try:
                        ok, result = True, self._call(method, args)
                    except Exception as exc:  # the caller raises it (CapacityExceeded → 409, ...)
                        ok, result = False, exc
                    rpc.send(wire.encode([ok, result, self.snapshot()]), self._server_lives)
        finally:
            rpc.close()

    def _call(self, method: str, args: list):
        if method == "live_figures":
            return self.engine.live_figures()
        if method not in CACHE_OPS:
            raise ValueError(f"the engine has no operation {method!r}")
        return getattr(self.cache, method)(*args)

    def close(self) -> None:
        self.stopping = True
        self._rpc.join(5)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
        with self._waker_lock:
            self._waker_open = False
            os.close(self._waker)
        os.close(self._woken)
        self.channel.close()
