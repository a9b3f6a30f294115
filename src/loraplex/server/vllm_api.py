"""`POST /v1/completions` and `POST /v1/chat/completions` on the vLLM engine: loraplex's tenancy,
resolution, admission and residency in front, vLLM's OpenAI serving layer for the request itself (so
every parameter vLLM serves works: n, best_of, min_p, echo, response_format, tools, logprobs,
...)."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from loraplex.server.disconnect import ClientGone, until_gone, watch
from loraplex.server.errors import APIError, validation_error
from loraplex.server.middleware import CLIENT_CLOSED

if TYPE_CHECKING:
    from loraplex.server.middleware import RequestContext
    from loraplex.server.server import Server


async def respond(request: Request, server: Server, ctx: RequestContext, body: bytes, chat: bool):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    asked = req.model
    target = await server.resolve(ctx, asked, req.user)
    engine = server.engine
    try:
        ticket = server.admit(ctx.tenant)
    except APIError as exc:
        ctx.denied = exc.code == "tenant_quota_exceeded"
        raise
    server.resolver.started(target)
    our_id = uuid.uuid4().hex
    engine.track(our_id)
    req.request_id = our_id
    held = None

    def finish() -> None:
        if held is not None:
            engine.adapters.release(target.ref.key, target.ref.tenant)
        ticket.close()
        server.resolver.finished(target)
        _record(ctx, engine.untrack(our_id))

    gone = watch(request)
    try:
        if target.ref is not None:
            engine.adapters.record_request(target.ref)
            held = await until_gone(engine.adapters.acquire(target.ref), gone)
            engine.serve_as(str(target.ref.key), held)
            req.model = str(target.ref.key)
        else:
            req.model = server.config.served_model_name
        ticket.started()
        serving = engine.serving_chat if chat else engine.serving_completion
        call = (
            serving.create_chat_completion(req, None)
            if chat
            else serving.create_completion(req, None)
        )
        result = await until_gone(_answer(call), gone)
    except ClientGone:
        ctx.status = CLIENT_CLOSED
        finish()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        finish()
        raise
    finally:
        gone.cancel()
    if isinstance(result, dict):
        finish()
        result["model"] = asked
        return JSONResponse(result)
    return _Stream(_renamed(result, req.model, asked, ctx), finish)


async def _answer(call):
    """vLLM's answer as a dict, or its event stream; its refusals as our errors."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        result = await call
    except (VLLMValidationError, ValueError, TypeError, NotImplementedError) as exc:
        raise APIError(400, str(exc), "invalid_value", getattr(exc, "parameter", None)) from None
    except (EngineDeadError, EngineGenerateError) as exc:
        raise APIError(503, f"the vLLM engine failed: {exc}", "engine_unavailable") from None
    if isinstance(result, ErrorResponse):
        error = result.error
        raise APIError(error.code, error.message, _code(error.type), error.param)
    if hasattr(result, "model_dump"):
        return result.model_dump(mode="json", exclude_none=False)
    return result


async def _renamed(events, served: str, asked: str, ctx: RequestContext):
    """vLLM's server-sent events with `model` as the client named it (vLLM writes compact JSON, so
    the field is replaced as text, without parsing each token's chunk); an error event recorded as
    the status."""
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


def _record(ctx: RequestContext, tracked) -> None:
    if tracked is None:
        return
    audit = ctx.audit
    audit["prompt_tokens"] = tracked.prompt_tokens
    audit["completion_tokens"] = sum(tracked.completion_tokens.values())
    if tracked.first_token_at is not None:
        audit["ttft_s"] = tracked.first_token_at - ctx.arrival
        tokens = max(tracked.completion_tokens.values(), default=0)
        if tokens > 1:
            audit["tpot_s"] = (tracked.last_token_at - tracked.first_token_at) / (tokens - 1)


def _code(error_type: str) -> str:
    return {"BadRequestError": "invalid_value", "NotFoundError": "model_not_found"}.get(
        error_type, error_type
    )
