"""`POST /v1/completions` and `POST /v1/chat/completions` on an engine's own OpenAI serving layer
(vLLM's, so that every parameter it serves works: n, best_of, min_p, echo, response_format, tools,
logprobs, ...): loraplex's tenancy, resolution, admission and residency in front, the same admit →
acquire → run → finish steps as the server's own layer."""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from loraplex.engines.contract import OpenAIServing, RequestUsage
from loraplex.server.disconnect import watch
from loraplex.server.errors import validation_error
from loraplex.server.middleware import CLIENT_CLOSED

if TYPE_CHECKING:
    from loraplex.server.middleware import RequestContext
    from loraplex.server.server import Server


class ServingLayer:
    """The completions endpoints over an engine's `OpenAIServing`."""

    def __init__(self, server: Server, serving: OpenAIServing):
        self.server = server
        self.serving = serving
        # The engine's request ids. Not uuid4: os.urandom drops the GIL, which another busy thread
        # (vLLM's output handler, a loader) then holds for a while.
        self._ids = random.Random()

    async def respond(
        self, request: Request, ctx: RequestContext, body: bytes, chat: bool
    ) -> Response:
        server, serving = self.server, self.serving
        try:
            req = serving.parse(body, chat)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        asked = req.model
        target = await server.resolve(ctx, asked, req.user)
        admitted = server.admit_request(ctx, target)
        our_id = f"{self._ids.getrandbits(128):032x}"
        serving.track(our_id)
        admitted.at_finish(lambda: _record(ctx, serving.untrack(our_id)))
        req.request_id = our_id
        # the name vLLM's layer serves the request as: exactly this key's adapter
        served = str(target.ref.key) if target.ref is not None else serving.served_model_name

        async def start():
            admitted.started()
            return await serving.answer(req, chat, served, admitted.held)

        gone = watch(request)
        try:
            result = await server.run(admitted, gone, start)
        finally:
            gone.cancel()
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(result, dict):
            admitted.finish()
            result["model"] = asked
            return JSONResponse(result)
        return _Stream(_renamed(result, served, asked, ctx), admitted.finish)


async def _renamed(events, served: str, asked: str, ctx: RequestContext):
    """The engine's server-sent events with `model` as the client named it (vLLM writes compact
    JSON, so the field is replaced as text, without parsing each token's chunk); an error event
    recorded as the status."""
    theirs, ours = f'"model":{json.dumps(served)}', f'"model":{json.dumps(asked)}'
    async for event in events:
        if event.startswith('data: {"error"'):
            ctx.status = json.loads(event[6:])["error"].get("code") or 500
        yield event.replace(theirs, ours, 1)


class _Stream(StreamingResponse):
    """The event stream; however it ends (done, error, client gone), `finish` runs once after it."""

    def __init__(self, content, finish):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.finish = finish

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.finish()


def _record(ctx: RequestContext, usage: RequestUsage | None) -> None:
    if usage is None:
        return
    audit = ctx.audit
    audit["prompt_tokens"] = usage.prompt_tokens
    audit["completion_tokens"] = sum(usage.completion_tokens.values())
    if usage.first_token_at is not None:
        audit["ttft_s"] = usage.first_token_at - ctx.arrival
        tokens = max(usage.completion_tokens.values(), default=0)
        if tokens > 1:
            assert usage.last_token_at is not None  # set with the first
            audit["tpot_s"] = (usage.last_token_at - usage.first_token_at) / (tokens - 1)
