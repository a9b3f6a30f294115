"""One HTTP request's prompts through the engine: admitted, submitted, first outputs awaited (so
that errors before the first token are proper HTTP errors), then streamed or collected; closed
exactly once."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.engines.contract import Generation
from loraplex.engines.requests import RequestOutput, SamplingParams
from loraplex.server.adapters import Target
from loraplex.server.admission import Admitted
from loraplex.server.middleware import RequestContext


@dataclass
class ChoiceState:
    """What one prompt has produced so far."""

    index: int
    prompt_index: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    def add(self, out: RequestOutput, now: float) -> None:
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.cumulative_logprob is not None:
            self.cumulative_logprob = out.cumulative_logprob
        if out.token_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        if out.finished:
            self.finish_reason = out.finish_reason


class RequestRun:
    """One request's sequences in the engine, from submission to its answer."""

    def __init__(
        self,
        generation: Generation,
        ctx: RequestContext,
        target: Target,
        prompts: list[list[int]],
        params: SamplingParams,
        admitted: Admitted,
        ids: random.Random,
    ):
        """`ids`: where the engine's request ids come from."""
        self.ctx = ctx
        self.target = target
        self.params = params
        self.admitted = admitted
        self.prompts = prompts
        # One choice per sequence: prompt i's sequence j is choice i * num_seqs + j, as vLLM numbers
        # them.
        self.num_seqs = params.num_seqs
        self.choices = [
            ChoiceState(i, i // self.num_seqs) for i in range(len(prompts) * self.num_seqs)
        ]
        # The engine's ids are ours: the client's x-request-id names the response and the audit
        # line, but two clients (or one retrying) may send the same one, and the engine routes
        # outputs and aborts by id. Not uuid4: os.urandom drops the GIL, which a busy engine thread
        # then holds for a while.
        self._ids = [f"{ids.getrandbits(128):032x}" for _ in prompts]
        # One client request is one cache hit or miss, however many prompts it has.
        self._streams = [
            generation.generate(p, params, target.ref, rid, counted=i == 0)
            for i, (p, rid) in enumerate(zip(prompts, self._ids))
        ]
        self._firsts: list[RequestOutput] = []
        self._pumps: list[asyncio.Task] = []
        self.queue_wait_s: float | None = None
        self._closed = False
        admitted.at_finish(self._record)

    async def start(self) -> None:
        """Wait for every prompt's first output; raises the engine's error (bad request, adapter
        unavailable)."""
        try:
            for index, stream in enumerate(self._streams):
                first = await anext(stream)
                self._choice(index, first).add(first, time.monotonic())
                self._firsts.append(first)
                if index == 0:
                    self.queue_wait_s = first.queue_wait_s
        except BaseException:
            await self.close()
            raise
        self.admitted.started()

    def _choice(self, prompt_index: int, out: RequestOutput) -> ChoiceState:
        return self.choices[prompt_index * self.num_seqs + out.index]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every prompt has finished; choice state is updated before
        each."""
        for index, out in enumerate(self._firsts):  # already counted in the choices by start()
            yield self._choice(index, out).index, out
        # n > 1: its other sequences go on
        live = [
            i for i, out in enumerate(self._firsts) if not (out.finished and self.num_seqs == 1)
        ]
        if len(live) == 1:
            async for out in self._streams[live[0]]:
                choice = self._choice(live[0], out)
                choice.add(out, time.monotonic())
                yield choice.index, out
        elif live:
            async for index, out in self._merged(live):
                yield index, out

    async def _merged(self, live: list[int]) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for out in self._streams[index]:
                    await queue.put((index, out, None))
            except Exception as exc:
                await queue.put((index, None, exc))
            await queue.put((index, None, None))

        self._pumps = [asyncio.create_task(pump(i)) for i in live]
        try:
            remaining = len(live)
            while remaining:
                index, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    remaining -= 1
                    continue
                choice = self._choice(index, out)
                choice.add(out, time.monotonic())
                yield choice.index, out
        finally:
            # no await here: this may run inside a cancelled scope; close() waits for the pumps
            for task in self._pumps:
                task.cancel()

    async def close(self) -> None:
        """Abort what still runs (a client gone, an error), finish the admitted request (its
        ticket, its adapter's count, the timings recorded)."""
        if self._closed:
            return
        self._closed = True
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
        self.admitted.finish()

    @property
    def is_finished(self) -> bool:
        """Every choice has its finish reason (its last output is in)."""
        return all(c.finish_reason is not None for c in self.choices)

    def returned_choices(self) -> list[ChoiceState]:
        """The choices the answer holds: with best_of, each prompt's n of highest cumulative
        logprob, numbered again from 0 (as vLLM did)."""
        n = self.params.n
        if self.num_seqs == n:
            return self.choices
        out: list[ChoiceState] = []
        for start in range(0, len(self.choices), self.num_seqs):
            group = self.choices[start : start + self.num_seqs]
            best = sorted(group, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
            for choice in best:
                out.append(dataclasses.replace(choice, index=len(out)))
        return out

    def _record(self) -> None:
        first = self.choices[0]
        audit = self.ctx.audit
        audit["prompt_tokens"], audit["completion_tokens"] = self.usage_counts
        audit["finish_reason"] = first.finish_reason
        if self.queue_wait_s is not None:
            audit["queue_wait_s"] = self.queue_wait_s
        if first.first_token_at is not None:
            audit["ttft_s"] = first.first_token_at - self.ctx.arrival
            if first.num_output_tokens > 1:
                assert first.last_token_at is not None  # set with the first
                audit["tpot_s"] = (first.last_token_at - first.first_token_at) / (
                    first.num_output_tokens - 1
                )

    @property
    def usage_counts(self) -> tuple[int, int]:
        """Prompt tokens once per prompt, and the output tokens of the choices returned, as vLLM
        counts."""
        prompt_tokens = sum(c.num_prompt_tokens for c in self.choices[:: self.num_seqs])
        return prompt_tokens, sum(c.num_output_tokens for c in self.returned_choices())
