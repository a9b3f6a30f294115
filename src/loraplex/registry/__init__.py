"""The control plane: which adapters exist, which revision a name means, who may use it, where its bytes are."""

from loraplex.registry.errors import (
    AdapterNotFound,
    AdapterRejected,
    ArtifactUnavailable,
    DigestMismatch,
    LifecycleError,
    RegistryError,
    ReleaseCheckFailed,
    RevisionUnavailable,
    SchemaTooNew,
    UnsafeLocation,
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
from loraplex.registry.store import (
    AllowList,
    ArtifactStore,
    Pieces,
    canonical_digest,
    digest_and_pieces,
    fetch_artifact,
    serve_store,
)

__all__ = [
    "AdapterNotFound",
    "AdapterRecord",
    "AdapterRejected",
    "AllowList",
    "ArtifactStore",
    "ArtifactUnavailable",
    "AuditRecord",
    "DigestMismatch",
    "EvalCase",
    "KeyRecord",
    "LifecycleError",
    "Pieces",
    "Registry",
    "RegistryError",
    "ReleaseCheckFailed",
    "ReleaseChecks",
    "RevisionRecord",
    "RevisionUnavailable",
    "SchemaTooNew",
    "TenantRecord",
    "UnsafeLocation",
    "canonical_digest",
    "digest_and_pieces",
    "fetch_artifact",
    "serve_store",
]
