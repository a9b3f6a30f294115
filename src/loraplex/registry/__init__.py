"""The control plane: which adapters exist, which revision a name means, who may use it, where its
bytes are."""

from loraplex.registry.errors import (
    AdapterNotFound,
    AdapterRejected,
    LifecycleError,
    RegistryError,
    ReleaseCheckFailed,
    RevisionUnavailable,
    SchemaTooNew,
)
from loraplex.registry.records import (
    AdapterRecord,
    AuditRecord,
    KeyRecord,
    RevisionRecord,
    TenantRecord,
)
from loraplex.registry.registry import Registry
from loraplex.registry.release import EvalCase, ReleaseChecks

__all__ = [
    "AdapterNotFound",
    "AdapterRecord",
    "AdapterRejected",
    "AuditRecord",
    "EvalCase",
    "KeyRecord",
    "LifecycleError",
    "Registry",
    "RegistryError",
    "ReleaseCheckFailed",
    "ReleaseChecks",
    "RevisionRecord",
    "RevisionUnavailable",
    "SchemaTooNew",
    "TenantRecord",
]
