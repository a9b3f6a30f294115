"""Every error the registry raises. Messages say what is wrong and what to do about it."""

from __future__ import annotations

from loraplex.lora_format import AdapterRejected

__all__ = [
    "AdapterNotFound",
    "AdapterRejected",
    "LifecycleError",
    "RegistryError",
    "ReleaseCheckFailed",
    "RevisionUnavailable",
    "SchemaTooNew",
]


class RegistryError(Exception):
    """Base of the registry's own errors (AdapterRejected, from validation, is a ValueError)."""


class AdapterNotFound(RegistryError):
    """Unknown name or revision, or one the tenant may not use: the message is the same for both."""

    def __init__(self, model: str):
        super().__init__(f"model {model!r} not found")
        self.model = model


class RevisionUnavailable(RegistryError):
    """The name exists for this tenant but no revision may be served (quarantined, or no
    traffic)."""


class LifecycleError(RegistryError):
    """A status or traffic change that the life cycle does not allow."""


class ReleaseCheckFailed(LifecycleError):
    """A release check (prewarm, eval set, health probe) refused a promotion."""


class SchemaTooNew(RegistryError):
    """The database was written by a newer loraplex; this one refuses to touch it."""
