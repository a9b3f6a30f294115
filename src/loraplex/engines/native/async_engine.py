"""The engine's step loop on its own thread, with an async iterator of outputs per request."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from loraplex.engines.contract import Generation
from loraplex.engines.native.sequence import RequestOutput, SamplingParams
from loraplex.engines.native.streams import Streams, request_stream
from loraplex.residency.key import AdapterRef

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What the step thread drives: the engine's own loop (`LLMEngine`)."""

    scheduler: Any  # its `running` requests
    adapters: Any  # its residency's `loading`
    grammars: Any  # `matcher` of a structured output

    def has_work(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def fail_all(self, error: Exception) -> list[RequestOutput]: ...
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None,
        request_id: str,
        counted: bool,
        matcher: Any,
    ) -> Any: ...
    def abort(self, request_id: str) -> None: ...
    def close(self) -> None: ...


class AsyncEngine(Generation):
    def __init__(self, engine: Steps):
        self.engine = engine
        self._streams: Streams = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() or self._stopping

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug: fail what is in flight rather than hang every client
                log.exception("engine step failed")
                outputs = self.engine.fail_all(exc)
            for out in outputs:
                self._deliver(out)
            if not self.engine.scheduler.running and self.engine.adapters.loading:
                self._wait_for_a_load()

    def _wait_for_a_load(self) -> None:
        """Every request waits on a load: sleep until one lands or a request comes in."""
        for future in list(self.engine.adapters.loading.values()):
            future.add_done_callback(self._wake_up)
        self._wake.wait(0.05)
        self._wake.clear()

    def _wake_up(self, _future) -> None:
        self._wake.set()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        request_id: str | None = None,
        counted: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs as the request advances (of all its sequences, told apart by `index`); leaving
        the loop early (a client gone) aborts it at once. `counted`: as in
        `LLMEngine.add_request`."""
        request_id = request_id or uuid.uuid4().hex

        async def start() -> None:
            matcher = None
            if params.structured is not None:  # compiling can take a while: off the event loop
                matcher = await asyncio.to_thread(self.engine.grammars.matcher, params.structured)
            self.engine.add_request(prompt_ids, params, adapter, request_id, counted, matcher)
            self._wake.set()

        def abort() -> None:
            self.engine.abort(request_id)
            self._wake.set()

        return request_stream(self._streams, request_id, params.num_seqs, start, abort)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()
