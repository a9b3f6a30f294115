"""Per-request context, and the ASGI middleware that puts the loraplex headers on every response,
turns unexpected exceptions into a 500 in the OpenAI error shape, and closes each inference request
with its metrics and audit line."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from loraplex.server.errors import APIError, error_response

log = logging.getLogger(__name__)
Endpoint = Callable[[Request], Awaitable[Response]]

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CLIENT_CLOSED = (
    499  # the client went away before the end (the nginx convention), recorded, never sent
)


@dataclass
class RequestContext:
    """What the handlers learn about one request; read back by the middleware when the response
    ends."""

    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    is_inference: bool = False
    endpoint: str | None = None
    tenant: str | None = None
    adapter: str = ""  # x-loraplex-adapter: name@revision (the served name for the base model)
    adapter_name: str | None = None
    revision: str | None = None
    digest: str = ""
    rank: int | None = None
    in_split: bool = False  # its name's traffic is split (a canary beside the stable)
    tier: str = ""
    denied: bool = False
    status: int | None = (
        None  # the outcome when it differs from the HTTP status (an error mid-stream)
    )
    error_code: str | None = None
    audit: dict = field(default_factory=dict)  # timings and token counts

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"x-request-id", self.request_id.encode())]
        if self.is_inference:
            out += [
                (b"x-loraplex-adapter", self.adapter.encode()),
                (b"x-loraplex-adapter-digest", self.digest.encode()),
                (b"x-loraplex-cache-tier", self.tier.encode()),
            ]
        return out


class RequestMiddleware:
    """Pure ASGI (no per-request task or body buffering, unlike BaseHTTPMiddleware).

    `direct`: endpoints by path, for POST requests called here rather than through the router: the
    inference endpoints take the request and give a response, so the router's layers (matching
    every route, exception middleware, exit stacks, dependencies) add nothing to them but their
    cost, a sizable part of a short request's; errors become answers as the router's handlers make
    them."""

    def __init__(
        self,
        app,
        on_done: Callable[[RequestContext, int], None],
        direct: dict[str, Endpoint] | None = None,
    ):
        self.app = app
        self.on_done = on_done
        self.direct = direct or {}
        self._ids = random.Random()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ctx = RequestContext(_request_id(scope, self._ids))
        scope.setdefault("state", {})["ctx"] = ctx
        started: list[int] = []

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                started.append(message["status"])
                message = {**message, "headers": [*message.get("headers", []), *ctx.headers()]}
            await send(message)

        try:
            endpoint = self._direct_endpoint(scope)
            if endpoint is None:
                await self.app(scope, receive, send_with_headers)
            else:
                await _call(endpoint, ctx, scope, receive, send_with_headers)
        except Exception as exc:  # a bug: answer 500 in the OpenAI shape, keep serving
            log.exception("request %s failed", ctx.request_id)
            ctx.error_code = ctx.error_code or "internal_error"
            if not started:
                error = APIError(
                    500,
                    f"internal error ({type(exc).__name__}); request id {ctx.request_id}",
                    "internal_error",
                )
                await error.response()(scope, receive, send_with_headers)
            else:
                ctx.status = 500
        finally:
            if ctx.is_inference:
                self.on_done(ctx, ctx.status or (started[0] if started else CLIENT_CLOSED))

    def _direct_endpoint(self, scope) -> Endpoint | None:
        if scope["method"] != "POST" or scope.get("root_path"):  # mounted: the router's job
            return None
        return self.direct.get(scope["path"])


async def _call(endpoint: Endpoint, ctx: RequestContext, scope, receive, send) -> None:
    try:
        response = await endpoint(Request(scope, receive, send))
    except Exception as exc:
        response = error_response(exc, ctx)
        if response is None:
            raise
    await response(scope, receive, send)


def _request_id(scope, ids: random.Random) -> str:
    """The client's id when it is a plain token, else 128 random bits. Not uuid4: os.urandom drops
    the GIL, and taking it back from the busy engine thread costs about a millisecond per
    request."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _REQUEST_ID_RE.fullmatch(text):
                return text
    return f"{ids.getrandbits(128):032x}"
