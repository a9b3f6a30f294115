"""The one place where exceptions become HTTP codes and the OpenAI error shape.

`{"error": {"message", "type", "code", "param"}}`: 400 bad request, 401 no or bad key, 404 unknown
model (also another tenant's adapter), 409 an admin change that conflicts with the current state,
413 body too large, 429 over capacity or quota, 503 adapter could not be loaded or the server is
shutting down, 500 only for bugs.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loraplex.artifacts import ArtifactError, ArtifactUnavailable, DigestMismatch, UnsafeLocation
from loraplex.engines.errors import (
    EngineUnavailable,
    InvalidRequest,
    NonFiniteLogits,
    RequestRefused,
)
from loraplex.lora_format import AdapterRejected
from loraplex.registry.errors import (
    AdapterNotFound,
    LifecycleError,
    RegistryError,
    RevisionUnavailable,
)
from loraplex.residency.errors import AdapterInFlight, AdapterUnavailable, CapacityExceeded

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    500: "server_error",
}


class APIError(Exception):
    """An error answer: HTTP status, a message the caller can act on, and the OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "api_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(model: str) -> APIError:
    """The same answer for a name that does not exist and one the tenant may not use."""
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "model_not_found",
        "model",
    )


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_api_key")


def overloaded(message: str, retry_after_s: int = 1, code: str = "rate_limit_exceeded") -> APIError:
    return APIError(429, message, code, headers={"Retry-After": str(retry_after_s)})


def as_api_error(exc: Exception) -> APIError | None:
    """The answer for a known exception; None for anything else (a bug: 500)."""
    match exc:
        case APIError():
            return exc
        case InvalidRequest():
            return APIError(400, str(exc), "invalid_value", exc.param)
        case NonFiniteLogits():
            return APIError(500, str(exc), "non_finite_logits")
        case EngineUnavailable():
            return APIError(503, str(exc), "engine_unavailable")
        case RequestRefused():
            return APIError(exc.status, exc.message, exc.code, exc.param)
        case AdapterRejected():
            return APIError(400, str(exc), "adapter_rejected", exc.field)
        case AdapterNotFound():
            return not_found(exc.model)
        case RevisionUnavailable():
            return APIError(404, str(exc), "model_not_available", "model")
        case AdapterUnavailable():
            # the cause is in the server log
            return APIError(503, exc.public, "adapter_unavailable")
        case ArtifactUnavailable() | DigestMismatch():
            return APIError(503, str(exc), "adapter_unavailable")
        case UnsafeLocation():
            return APIError(400, str(exc), "location_not_allowed")
        case AdapterInFlight():
            return APIError(409, str(exc), "adapter_in_flight")
        case CapacityExceeded():
            return APIError(409, str(exc), "capacity_exceeded")
        case LifecycleError():
            return APIError(409, str(exc), "lifecycle_conflict")
        case RegistryError():
            return APIError(400, str(exc), "registry_error")
        case HTTPException():
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return APIError(exc.status_code, str(exc.detail), code, headers=dict(exc.headers or {}))
        case RequestValidationError():
            return validation_error(exc.errors(), prefix_skip=1)
    return None


def validation_error(errors, prefix_skip: int = 0) -> APIError:
    """400 from pydantic errors, naming the first offending field (`messages.0.role`)."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())[prefix_skip:]]
    # Union members add their type name to the location ("prompt.str"); drop those for the caller.
    loc = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {first.get('msg')}", "invalid_json"
        )
    if first.get("type") == "extra_forbidden":
        return APIError(
            400, f"Unrecognized request argument supplied: {param}", "unknown_field", param
        )
    message = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {message}" if param else message, "invalid_type", param)


def _is_type_tag(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]")
        or "[" in part
    )


def error_response(exc: Exception, ctx) -> JSONResponse | None:
    """The answer for a known exception, its code kept on the request's context (the audit line
    says which refusal: quota, overload, not found, ...); None for anything else."""
    error = as_api_error(exc)
    if error is None:
        return None
    if ctx is not None:
        ctx.error_code = error.code
    return error.response()


def install_handlers(app: FastAPI) -> None:
    """Known exceptions → their error answers; unknown ones are turned into 500 by the request
    middleware."""

    async def handle(request: Request, exc: Exception):
        response = error_response(exc, getattr(request.state, "ctx", None))
        if response is None:
            raise exc
        return response

    for kind in (
        APIError,
        InvalidRequest,
        NonFiniteLogits,
        EngineUnavailable,
        RequestRefused,
        AdapterRejected,
        RegistryError,
        ArtifactError,
        AdapterUnavailable,
        AdapterInFlight,
        CapacityExceeded,
        HTTPException,
        RequestValidationError,
    ):
        app.add_exception_handler(kind, handle)
