"""The server's own OpenAI request layer, for an engine that generates tokens (`TokenEngine`): the
request parsed by loraplex's schemas, tokenized here, run through the engine's generation
(`RequestRun`) and answered as JSON or server-sent events."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from loraplex.engines.contract import TokenEngine
from loraplex.engines.requests import SamplingParams
from loraplex.server import schemas
from loraplex.server.adapters import Target
from loraplex.server.disconnect import ClientGone, until_gone, watch
from loraplex.server.errors import APIError, as_api_error, validation_error
from loraplex.server.generation import RequestRun
from loraplex.server.middleware import CLIENT_CLOSED
from loraplex.server.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    import asyncio

    from loraplex.server.middleware import RequestContext
    from loraplex.server.server import Server

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


class TokenLayer:
    """The completions endpoints over a `TokenEngine`."""

    def __init__(self, server: Server, engine: TokenEngine):
        self.server = server
        self.engine = engine

    async def respond(
        self, request: Request, ctx: RequestContext, body: bytes, chat: bool
    ) -> Response:
        if chat:
            return await self.chat_completions(request, ctx, body)
        return await self.completions(request, ctx, body)

    async def completions(self, request: Request, ctx: RequestContext, body: bytes) -> Response:
        server = self.server
        req = _parse(body, CompletionRequest)
        target = await server.resolve(ctx, req.model, req.user)
        texts = req.prompts()
        prompts = [self.encode_prompt(p) for p in texts]
        echo = None
        # as vLLM: the prompt's text, and with logprobs its tokens' logprobs, before each choice's
        if req.echo:
            decode = self.engine.tokenizer.decode
            echo = [t if isinstance(t, str) else decode(ids) for t, ids in zip(texts, prompts)]
        prompt_only = bool(req.echo) and req.max_tokens == 0
        if prompt_only:  # as vLLM: one token is generated, the prompt alone is answered
            req.max_tokens = 1
        prompt_logprobs = req.logprobs if req.echo else None
        vocab_size = self.engine.model_config.vocab_size
        params = req.sampling_params(vocab_size, 16, req.logprobs, prompt_logprobs)
        fmt = CompletionFormat(
            ctx.request_id,
            req.model,
            self._token_text(),
            echo,
            prompts,
            prompt_only,
            bool(req.return_token_ids),
        )
        return await self._respond(request, ctx, target, prompts, params, fmt, req)

    async def chat_completions(
        self, request: Request, ctx: RequestContext, body: bytes
    ) -> Response:
        req = _parse(body, ChatCompletionRequest)
        target = await self.server.resolve(ctx, req.model, req.user)
        messages = [m.for_template() for m in req.messages]
        prompt = self.encode_chat(messages)
        default_max = max(1, self.engine.max_model_len - len(prompt))
        params = req.sampling_params(
            self.engine.model_config.vocab_size, default_max, req.num_logprobs()
        )
        # vLLM's echo: the last message's content first, when it is the assistant's (the role
        # answering)
        echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else ""
        fmt = ChatFormat(ctx.request_id, req.model, self._token_text(), echo)
        return await self._respond(request, ctx, target, [prompt], params, fmt, req)

    def _token_text(self):
        """How logprobs name a token: its text with special tokens kept (EOS shows as `</s>`, as
        in vLLM), so a client sees in them why the output stopped."""
        decode = self.engine.tokenizer.decode
        return lambda ids: decode(ids, skip_special_tokens=False)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        limit = self.server.max_prompt_tokens
        if isinstance(prompt, str):
            # Tokens are far shorter than 64 characters: a longer text cannot fit, so skip
            # tokenizing it.
            if len(prompt) > 64 * limit:
                raise APIError(
                    400,
                    f"The prompt is longer than the limit of {limit} tokens (max_prompt_tokens).",
                    "prompt_too_long",
                    "prompt",
                )
            prompt = self.engine.tokenizer.encode(prompt)
        if not prompt:
            raise APIError(400, "The prompt is empty.", "invalid_value", "prompt")
        if len(prompt) > limit:
            raise APIError(
                400,
                f"The prompt has {len(prompt)} tokens, more than the limit of {limit} "
                "(max_prompt_tokens).",
                "prompt_too_long",
                "prompt",
            )
        return prompt

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.engine.tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", "messages") from None
        # the template adds the special tokens itself
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > self.server.max_prompt_tokens:
            raise APIError(
                400,
                f"The messages make a prompt of {len(ids)} tokens, more than the limit of "
                f"{self.server.max_prompt_tokens} (max_prompt_tokens).",
                "prompt_too_long",
                "messages",
            )
        return ids

    async def generate(
        self,
        ctx: RequestContext,
        target: Target,
        prompts: list[list[int]],
        params: SamplingParams,
        gone: asyncio.Future,
    ) -> RequestRun | None:
        """The started generation (every prompt's first output in); None when `gone` (the client
        left) ends first: the generation is then closed, and the request recorded as the client's
        leaving."""
        server = self.server
        admitted = server.admit_request(ctx, target)

        async def start() -> RequestRun:
            run = RequestRun(
                self.engine.generation, ctx, target, prompts, params, admitted, server.engine_ids
            )
            await run.start()  # closes the run if it fails or the client leaves
            return run

        return await server.run(admitted, gone, start)

    async def _respond(
        self, request: Request, ctx: RequestContext, target, prompts, params, fmt, req
    ) -> Response:
        """Generate and answer. A client that leaves stops its generation: while it waits for
        admission, for its adapter or for its first token, and while a plain answer is made (an
        event stream watches for it itself)."""
        gone = watch(request)
        try:
            run = await self.generate(ctx, target, prompts, params, gone)
            if run is None:
                return Response(status_code=CLIENT_CLOSED)  # never sent: the client is gone
            if req.stream:
                return _EventStream(_events(run, fmt, req.include_usage), run)
            try:
                # all in with the first outputs (max_tokens 1, an early stop): nothing to wait for
                if not run.is_finished:
                    await until_gone(_drain(run), gone)  # the engine's error, if any, is the answer
            except ClientGone:
                ctx.status = CLIENT_CLOSED
            finally:
                await run.close()  # after the outputs' generator has unwound
            return _json(fmt.final(run))
        finally:
            gone.cancel()


def _parse(body: bytes, model):
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    req.check_supported()
    return req


async def _drain(run: RequestRun) -> None:
    async for _ in run.outputs():
        pass


# As JSONResponse's and json.dumps's encodings, without building an encoder for each body.
_BODY = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_EVENT = json.JSONEncoder(separators=(",", ":"))


def _json(body: dict) -> Response:
    return Response(_BODY.encode(body).encode(), media_type="application/json")


def _sse(obj: dict) -> bytes:
    return b"data: " + _EVENT.encode(obj).encode() + b"\n\n"


async def _events(run: RequestRun, fmt, include_usage: bool):
    """Chunks; `usage` on the last one, or with `include_usage` in a chunk of its own (null on the
    others)."""

    def event(chunk: dict) -> bytes:
        if include_usage:
            chunk.setdefault("usage", None)
        return _sse(chunk)

    try:
        for chunk in fmt.opening(run):
            yield event(chunk)
        num_finished = 0
        async for index, out in run.outputs():
            if not (out.text or out.finished or out.logprobs or (fmt.token_ids and out.token_ids)):
                # tokens held back (half a character, a possible stop string): nothing to send yet,
                # unless the client asked for their ids
                continue
            num_finished += out.finished
            last = num_finished == len(run.choices)
            usage = schemas.usage(*run.usage_counts) if last and not include_usage else None
            yield event(fmt.chunk(run, index, out, usage))
        if include_usage:
            yield _sse(fmt.usage_chunk(schemas.usage(*run.usage_counts)))
    except Exception as exc:  # headers are out: the error goes in the stream, as OpenAI's API does
        error = as_api_error(exc)
        if error is None:
            # a bug: logged with its traceback, and the client told, as before the headers
            log.exception("request %s failed during its stream", run.ctx.request_id)
            error = APIError(
                500,
                f"internal error ({type(exc).__name__}); request id {run.ctx.request_id}",
                "internal_error",
            )
        run.ctx.status, run.ctx.error_code = error.status, error.code
        yield _sse(error.body())
    yield DONE


class _EventStream(StreamingResponse):
    """Server-sent events; whatever way the stream ends (done, error, client gone), the generation
    is closed here, outside the stream's cancelled task group, so aborting and recording cannot be
    cut short."""

    def __init__(self, content, run: RequestRun):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if (
                any(c.finish_reason is None for c in self.run.choices)
                and self.run.ctx.status is None
            ):
                self.run.ctx.status = CLIENT_CLOSED  # the client left before the end
            await self.run.close()


class CompletionFormat:
    def __init__(
        self,
        request_id: str,
        model: str,
        decode,
        echo: list[str] | None = None,
        prompts: list[list[int]] | None = None,
        prompt_only: bool = False,
        token_ids: bool = False,
    ):
        """`echo`: each prompt's text, put before its choices' text; `prompts`: their token ids;
        `prompt_only`: the echoed prompt without the output (echo with max_tokens 0); `token_ids`:
        vLLM's `return_token_ids`, the prompt's and the output's token ids in each choice."""
        self.request_id, self.model, self.decode = request_id, model, decode
        self.echo, self.prompts, self.prompt_only = echo, prompts, prompt_only
        self.token_ids = token_ids
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def opening(self, run: RequestRun) -> list[dict]:
        return []

    def _logprobs(self, index: int, entries: list[dict]) -> dict | None:
        if not entries:
            return None
        out = schemas.completion_logprobs(entries, self.decode, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def _prompt_entries(self, choice) -> list[dict]:
        """The prompt's tokens as logprob entries (the first token has no logprob)."""
        assert self.prompts is not None  # echo with prompt logprobs: given
        ids = self.prompts[choice.prompt_index]
        given = choice.prompt_logprobs or [None] * len(ids)
        return [e or {"token": t, "logprob": None, "top": None} for t, e in zip(ids, given)]

    def _prompt_ids(self, choice) -> list[int]:
        assert self.prompts is not None  # the completions endpoint gives them
        return list(self.prompts[choice.prompt_index])

    def _echoed(
        self, run: RequestRun, choice, text: str, entries: list[dict]
    ) -> tuple[str, list[dict]]:
        if self.echo is None:
            return text, entries
        if self.prompt_only:
            text, entries = "", []
        if run.params.prompt_logprobs is not None:
            entries = self._prompt_entries(choice) + entries
        return self.echo[choice.prompt_index] + text, entries

    def chunk(self, run: RequestRun, index: int, out, usage: dict | None) -> dict:
        text, entries = out.text, out.logprobs
        first = index not in self.echoed
        if first:
            self.echoed.add(index)
            text, entries = self._echoed(run, run.choices[index], text, entries)
        lp = self._logprobs(index, entries) if run.params.logprobs is not None else None
        reason = out.finish_reason if out.finished else None
        choice = schemas.completion_choice(index, text, reason, lp)
        if self.token_ids:
            prompt = self._prompt_ids(run.choices[index]) if first else None
            choice = schemas.with_token_ids(choice, prompt, list(out.token_ids))
        return schemas.completion(self.request_id, self.model, [choice], usage, chunk=True)

    def usage_chunk(self, usage: dict) -> dict:
        return schemas.completion(self.request_id, self.model, [], usage, chunk=True)

    def final(self, run: RequestRun) -> dict:
        choices = []
        for c in run.returned_choices():
            text, entries = self._echoed(run, c, "".join(c.text), c.logprobs)
            lp = self._logprobs(c.index, entries) if run.params.logprobs is not None else None
            choice = schemas.completion_choice(c.index, text, c.finish_reason, lp)
            if self.token_ids:
                choice = schemas.with_token_ids(choice, self._prompt_ids(c), c.token_ids)
            choices.append(choice)
        return schemas.completion(
            self.request_id, self.model, choices, schemas.usage(*run.usage_counts)
        )


class ChatFormat:
    token_ids = False
    """Chat has no `return_token_ids`."""

    def __init__(self, request_id: str, model: str, decode, echo: str = ""):
        """`echo`: text put before each choice's content."""
        self.request_id, self.model, self.decode, self.echo = request_id, model, decode, echo

    def opening(self, run: RequestRun) -> list[dict]:
        """The role first, as OpenAI's API sends it (then the echoed text, as vLLM does)."""
        deltas = [{"role": "assistant", "content": ""}]
        if self.echo:
            deltas.append({"content": self.echo})
        return [
            schemas.chat(
                self.request_id,
                self.model,
                [schemas.chat_delta(c.index, d, None)],
                None,
                chunk=True,
            )
            for d in deltas
            for c in run.choices
        ]

    def _logprobs(self, entries: list[dict], wanted: bool) -> dict | None:
        return schemas.chat_logprobs(entries, self.decode) if wanted and entries else None

    def chunk(self, run: RequestRun, index: int, out, usage: dict | None) -> dict:
        delta = {"content": out.text} if out.text or not out.finished else {}
        choice = schemas.chat_delta(
            index,
            delta,
            out.finish_reason if out.finished else None,
            self._logprobs(out.logprobs, run.params.logprobs is not None),
        )
        return schemas.chat(self.request_id, self.model, [choice], usage, chunk=True)

    def usage_chunk(self, usage: dict) -> dict:
        return schemas.chat(self.request_id, self.model, [], usage, chunk=True)

    def final(self, run: RequestRun) -> dict:
        choices = [
            schemas.chat_choice(
                c.index,
                self.echo + "".join(c.text),
                c.finish_reason,
                self._logprobs(c.logprobs, run.params.logprobs is not None),
            )
            for c in run.returned_choices()
        ]
        return schemas.chat(self.request_id, self.model, choices, schemas.usage(*run.usage_counts))
