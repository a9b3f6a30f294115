"""The engines' request errors, in a module without torch: the HTTP layer maps them, and the
commands that do not serve (the router, the registry, the tools) import that layer without loading
torch."""

from __future__ import annotations


class NonFiniteLogits(RuntimeError):
    """The model gave NaN or infinite logits for a sequence (its adapter's weights, say): that
    request fails, the others in the batch go on."""


class InvalidRequest(ValueError):
    """A request the engine cannot run; `param` names the field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class RequestRefused(Exception):
    """An engine's own request layer refused the request: its HTTP status, message, error code
    and the field at fault."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class EngineUnavailable(RuntimeError):
    """The engine has stopped (or never started): requests in flight and new ones fail."""
