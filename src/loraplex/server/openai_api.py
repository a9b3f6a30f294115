"""`POST /v1/completions`, `POST /v1/chat/completions` (JSON or server-sent events) and `GET
/v1/models`. The completions run through the request layer the engine picks (`RequestLayers`): the
server's own over the engine's generation (token_api.py), or the engine's own serving layer
(serving_api.py); both go admit → acquire → run → finish (`Server.admit_request`, `Server.run`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from loraplex.engines.contract import OpenAIServing, TokenEngine
from loraplex.server import serving_api, token_api
from loraplex.server.errors import APIError
from loraplex.server.listing import MAX_PAGE
from loraplex.server.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from loraplex.server.middleware import RequestContext
    from loraplex.server.server import Server

router = APIRouter()


class RequestLayer(Protocol):
    """Runs one OpenAI request from its body (read, within the size limit) to its answer."""

    async def respond(
        self, request: Request, ctx: RequestContext, body: bytes, chat: bool
    ) -> Response: ...


class RequestLayers:
    """The server's request layers, of which the engine picks its own (`Engine.request_layer`)."""

    def __init__(self, server: Server):
        self.server = server

    def over_tokens(self, engine: TokenEngine) -> RequestLayer:
        return token_api.TokenLayer(self.server, engine)

    def over_serving(self, serving: OpenAIServing) -> RequestLayer:
        return serving_api.ServingLayer(self.server, serving)


def _documented_body(model) -> dict:
    """The operation's OpenAPI request body: `model`'s schema with its definitions inlined.

    The handlers read the body themselves, to answer a bad one in the OpenAI error shape, so FastAPI
    does not see the model: this puts it in /openapi.json and /docs.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


@router.post("/v1/completions", openapi_extra=_documented_body(CompletionRequest))
async def completions(request: Request) -> Response:
    return await _respond(request, "completions", chat=False)


@router.post("/v1/chat/completions", openapi_extra=_documented_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    return await _respond(request, "chat.completions", chat=True)


async def _respond(request: Request, endpoint: str, chat: bool) -> Response:
    server: Server = request.app.state.server
    ctx: RequestContext = request.state.ctx
    ctx.is_inference, ctx.endpoint = True, endpoint
    # first: a refusal names its tenant
    ctx.tenant = await server.auth.tenant_of(request.headers.get("authorization"))
    await server.pause.wait()  # vLLM's /pause holds new requests until /resume
    server.check_accepting()
    body = await _read_body(request, server.config.settings.max_body_bytes)
    layer: RequestLayer = request.app.state.requests
    return await layer.respond(request, ctx, body, chat)


DIRECT_ENDPOINTS: dict[str, Callable[[Request], Awaitable[Response]]] = {
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
}
"""What the request middleware calls without the router (`RequestMiddleware`); the routes stay for
/openapi.json and /docs."""


@router.get("/v1/models")
async def models(request: Request, after: str | None = None, limit: str | None = None):
    """The models this tenant may use, from memory. With `limit` (and `after`, the last id of the
    page before) one page, as OpenAI's lists page: `has_more`, `first_id`, `last_id`."""
    server: Server = request.app.state.server
    tenant = await server.auth.tenant_of(request.headers.get("authorization"))
    count = None if limit is None else _limit(limit)
    await server.catalog.current()  # this process's own commits listed (no query when none)
    # a listing of the whole catalog is made in short turns of the loop: the streams go on between
    parts = await server.listing.body(tenant, after, count)
    if len(parts) == 1:
        return Response(parts[0], media_type="application/json")
    size = str(sum(map(len, parts)))
    return StreamingResponse(
        _sent(parts), media_type="application/json", headers={"content-length": size}
    )


async def _sent(parts: tuple[bytes, ...]):
    """The parts of a body, the loop free for other work between two."""
    for part in parts:
        yield part
        await asyncio.sleep(0)


def _limit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise APIError(
            400,
            f"limit {text!r}: give a whole number from 1 to {MAX_PAGE}",
            "invalid_value",
            "limit",
        )
    return int(text)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than the limit of {limit} bytes.", "request_too_large"
    )
