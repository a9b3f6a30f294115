"""The native engine's request errors: the engines' own (`engines.errors`), under the names its
modules import."""

from loraplex.engines.errors import EngineUnavailable, InvalidRequest, NonFiniteLogits

__all__ = ["EngineUnavailable", "InvalidRequest", "NonFiniteLogits"]
