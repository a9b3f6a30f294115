"""The API server's side of the engine process (core.py): the engine's interface for the server
(requests, aborts, outputs, adapter operations, residency, figures, cache events) over two Unix
sockets (channel.py)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from loraplex.engines.contract import (
    AdapterResidency,
    Generation,
    Residency,
    ResidencySnapshot,
)
from loraplex.engines.native import wire
from loraplex.engines.native.channel import Channel, Listener
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.core import EngineInfo, run_engine
from loraplex.engines.native.errors import EngineUnavailable
from loraplex.engines.native.front import NativeFront
from loraplex.engines.native.sequence import RequestOutput, SamplingParams
from loraplex.engines.native.streams import Streams, request_stream
from loraplex.engines.native.structured import Grammars
from loraplex.engines.native.tokenizer import Tokenizer
from loraplex.model_config import ModelConfig
from loraplex.residency.events import Event
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.spawn import without_main_module

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long the engine process may take to load the model."""
POLL_MS = 100
"""How often a wait on the engine looks whether its process still runs."""


class EngineClient(NativeFront, Generation):
    """The native engine run by a process of its own (`--engine-core process`); the server uses it
    as it uses an `LLMEngine` and its `AsyncEngine` together."""

    def __init__(self, config: EngineConfig, policy=None):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer(config.model_dir)  # HTTP's tokenization stays on this side
        self._dir = tempfile.mkdtemp(prefix="loraplex-engine-")  # 0700: only this user connects
        addresses = {name: os.path.join(self._dir, name) for name in ("engine", "rpc")}
        listeners = {name: Listener(path) for name, path in addresses.items()}
        self._channel: Channel | None = None  # requests and aborts out, outputs and events in
        self._rpc: Channel | None = None  # operations and their replies
        self._input_lock = threading.Lock()
        self._outbox: list[list] = []  # what this turn of the loop sends (`_send`)
        self._rpc_lock = threading.Lock()
        self._streams: Streams = {}
        self._dead: EngineUnavailable | None = None
        self._stopping = False
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine,
            args=(config, policy, addresses, os.getpid()),
            name="loraplex-engine",
            daemon=True,
        )
        with without_main_module():
            self.process.start()
        try:
            info = self._wait_ready(listeners)
        except BaseException:
            self._close_sockets()
            raise
        finally:
            for listener in listeners.values():
                listener.close()
        self.max_model_len = info.max_model_len
        self.base_model_digest = info.base_model_digest
        self.kv_budget = info.kv_budget
        self.num_kv_tokens = info.num_kv_tokens
        # the engine's grammars, compiled here too when asked (they are built at first use)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, info.eos_ids)
        self.adapters = CacheClient(self, info)
        self._loop: asyncio.AbstractEventLoop | None = None  # where the outputs are read
        assert self._channel is not None  # `_wait_ready` connected it or raised
        self._fd: int = self._channel.fileno()
        self._watcher: threading.Thread = threading.Thread(
            target=self._watch, name="engine-watch", daemon=True
        )
        self._watcher.start()

    def _wait_ready(self, listeners: dict[str, Listener]) -> EngineInfo:
        """The engine connects its channel first, then loads the model and says whether it could;
        its rpc channel is connected by then."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self._channel = listeners["engine"].accept(self.process.is_alive, START_TIMEOUT_S)
        messages: list[bytes] = []
        while self._channel is not None and not messages:
            messages = self._channel.receive(most=1)  # what follows waits for `attach`
            if messages or self._channel.at_eof:
                break
            if not self.process.is_alive():
                break
            if time.monotonic() > deadline:
                self.process.kill()
                raise EngineUnavailable(f"the engine process did not start in {START_TIMEOUT_S} s")
            self._channel.wait(POLL_MS / 1000)
        if not messages:
            self.process.join(10)
            raise EngineUnavailable(
                f"the engine process exited with code {self.process.exitcode} while starting"
            )
        kind, payload = wire.decode(messages[0])
        if kind == "failed":
            self.process.join(10)
            raise payload  # the engine's own error (a bad model directory, a KV budget too small)
        self._rpc = listeners["rpc"].accept(self.process.is_alive, START_TIMEOUT_S)
        if self._rpc is None:
            raise EngineUnavailable("the engine process did not connect its operations channel")
        return payload

    # -- what crosses from the engine --------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on `loop`, the server's event loop, from now on: outputs reach
        their requests without a thread of ours between, which would contend with the loop for the
        GIL at every message. Cache events are handled there too (`on_event` must not block)."""
        if self._loop is loop:
            return
        self._detach()
        self._loop = loop
        loop.add_reader(self._fd, self._take_messages)
        # what came before (after the engine's "ready") is read now
        loop.call_soon(self._take_messages)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                loop.remove_reader(self._fd)
            else:
                loop.call_soon_threadsafe(loop.remove_reader, self._fd)
        except (RuntimeError, OSError, ValueError):  # that loop closed meanwhile
            pass

    def _take_messages(self) -> None:
        """Every message that has arrived from the engine."""
        assert self._channel is not None  # connected at start
        if self._stopping or self._channel.sock.fileno() < 0:  # closed under a stopping client
            return
        for data in self._channel.receive():
            _, snapshot, outputs, events = wire.decode(data)
            if snapshot is not None:
                self.adapters.take(snapshot)
            if outputs:
                self._route(wire.from_rows(RequestOutput, outputs))
            for event in events:
                try:
                    self.adapters.on_event(event)
                except Exception:
                    log.exception("handling the cache event %s failed", event)
        if self._channel.at_eof:  # the engine process is ending: the watcher tells its requests
            assert self._loop is not None  # the loop that reads the messages
            self._loop.remove_reader(self._fd)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue: at once on this loop, with one wake-up of each other
        loop per message."""
        here = self._loop
        others: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream[0] is here:
                stream[1].put_nowait(out)
            else:
                others.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in others.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop has closed: nobody waits on those outputs
                pass

    def _watch(self) -> None:
        """Wait for the engine process to end; unless it was asked to, its requests fail."""
        multiprocessing.connection.wait([self.process.sentinel])
        if self._stopping:
            return
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._die)
                return
            except RuntimeError:  # the loop has closed
                self._loop = None
        self._die()

    def _die(self) -> None:
        """The engine process is gone: every request in flight ends with 503 engine_unavailable."""
        if self._loop is not None:
            self._take_messages()  # what it sent before it ended
        code = self.process.exitcode
        log.error("the engine process exited (code %s); requests in flight fail", code)
        self._dead = EngineUnavailable(
            f"the engine process has stopped (exit code {code}); retry on another worker"
        )
        for request_id in list(self._streams):
            error = RequestOutput(request_id, [], "", [], True, None, 0, 0, self._dead)
            self._route([error])

    # -- requests --------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """Until the watcher has seen the process end (`_die`): every request asks, and asking the
        process (a waitpid) would cost each one a system call."""
        return self._dead is None

    def _send(self, message: list) -> None:
        """On the loop that reads the outputs, the messages of one turn go together at its end
        (one encoding and one socket send for every request that came in that turn); from
        elsewhere at once."""
        loop = self._loop
        if loop is None or not _runs_on(loop):
            self._send_now([message])
            return
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if messages:
            self._send_now(messages)

    def _send_now(self, messages: list[list]) -> None:
        assert self._channel is not None  # connected at start
        if self._dead is not None or self._channel.sock.fileno() < 0:
            return
        with self._input_lock:
            self._channel.send(wire.encode(messages), self.process.is_alive)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        request_id: str | None = None,
        counted: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As `AsyncEngine.generate`: outputs as the request advances; leaving early aborts it."""
        request_id = request_id or uuid.uuid4().hex

        async def start() -> None:
            loop = asyncio.get_running_loop()
            if self._loop is None or self._loop.is_closed():
                self.attach(loop)
            if self._dead is not None:  # it died before the stream was there to be failed
                raise self._dead
            self._send(["add", request_id, list(prompt_ids), params, adapter, counted])

        def abort() -> None:
            self._send(["abort", request_id])

        return request_stream(self._streams, request_id, params.num_seqs, start, abort)

    # -- operations and figures --------------------------------------------------------------------
    def call(self, method: str, *args):
        """An operation in the engine process; raises what it raised there."""
        with self._rpc_lock:
            if self._dead is not None:
                raise self._dead
            assert self._rpc is not None  # connected at start
            self._rpc.send(wire.encode([method, list(args)]), self.process.is_alive)
            while not (reply := self._rpc.receive()):
                if self._rpc.at_eof or not self.process.is_alive():
                    self._dead = self._dead or EngineUnavailable(
                        f"the engine process has stopped (exit code {self.process.exitcode})"
                    )
                    raise self._dead
                self._rpc.wait(POLL_MS / 1000)
            ok, result, snapshot = wire.decode(reply[0])
        self.adapters.take(snapshot)
        if not ok:
            raise result
        return result

    def live_figures(self) -> dict:
        return self.call("live_figures")

    @property
    def generation(self) -> EngineClient:
        return self

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.attach(asyncio.get_running_loop())  # the engine's messages on the server's loop

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self.process.is_alive():
            self._flush()
            self._send_now([["stop"]])  # now: the wait below may hold the loop
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._detach()
        self._watcher.join(timeout)
        self._close_sockets()

    def close(self) -> None:
        self.stop()

    def _close_sockets(self) -> None:
        for channel in (self._channel, self._rpc):
            if channel is not None:
                channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _runs_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs on this thread
        return False


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


Settles = Callable[[Residency | None], bool]
"""Whether an adapter's residency (None: the cache knows it no more) completes a watch."""


class CacheClient(AdapterResidency):
    """The engine's adapter cache as the server sees it: residency read from the latest snapshot,
    operations run in the engine process."""

    def __init__(self, client: EngineClient, info: EngineInfo):
        self._client = client
        self.cpu_bytes = info.cpu_bytes
        self.budgets = info.budgets
        """The budgets last applied (the server compares before it sends new ones)."""
        self.on_event: Callable[[Event], None] = lambda event: None
        self._lock = threading.Lock()
        self._snapshot = info.snapshot
        # per key, (future, whether a residency settles it): what `when_loaded` and
        # `when_released` give
        self._watchers: dict[AdapterKey, list[tuple[Future, Settles]]] = {}

    @property
    def slots(self) -> list[AdapterKey | None]:
        return self._snapshot.slots

    def take(self, snapshot: ResidencySnapshot) -> None:
        """A snapshot from either socket: the newest one wins."""
        with self._lock:
            if snapshot.seq > self._snapshot.seq:
                self._snapshot = snapshot
                for key in list(self._watchers):
                    self._settle(key)

    def when_loaded(self, key: AdapterKey) -> Future:
        return self._watch(key, lambda r: r is None or not r.loading)

    def when_released(self, key: AdapterKey) -> Future:
        return self._watch(key, lambda r: r is None or not r.in_use)

    def _watch(self, key: AdapterKey, done: Settles) -> Future:
        future: Future = Future()
        with self._lock:
            self._watchers.setdefault(key, []).append((future, done))
            self._settle(key)
        return future

    def _settle(self, key: AdapterKey) -> None:
        residency = self._snapshot.residency.get(key)
        left = []
        for future, done in self._watchers.pop(key):
            if done(residency):
                future.set_result(None)
            else:
                left.append((future, done))
        if left:
            self._watchers[key] = left

    def _of(self, key: AdapterKey) -> Residency | None:
        return self._snapshot.residency.get(key)

    def tier_of(self, key: AdapterKey) -> str:
        r = self._of(key)
        return r.tier if r is not None else "remote"

    def pinned(self, key: AdapterKey) -> str | None:
        r = self._of(key)
        return r.pinned if r is not None else None

    def is_loading(self, key: AdapterKey) -> bool:
        r = self._of(key)
        return r is not None and r.loading

    def in_host_memory(self, key: AdapterKey) -> bool:
        r = self._of(key)
        return r is not None and r.in_host_memory

    def pin(self, ref: AdapterRef, tier: str) -> None:
        self._client.call("pin", ref, tier)

    def unpin(self, key: AdapterKey) -> None:
        self._client.call("unpin", key)

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        self._client.call("restore_pin", key, pinned)

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        self._client.call("prewarm", ref, tier)

    def evict(self, key: AdapterKey) -> None:
        self._client.call("evict", key)

    def forget(self, key: AdapterKey) -> None:
        self._client.call("forget", key)

    def set_budgets(self, budgets) -> None:
        self._client.call("set_budgets", budgets)
        self.budgets = budgets

    def budget_state(self) -> dict:
        return self._client.call("budget_state")

    def state(self) -> dict:
        return self._client.call("state")
