"""Content-addressed artifact I/O: digests and piece lists, the local store, remote fetches (and
pushes to OCI registries) and the places they may read from. It imports nothing of the registry,
the cache or the engines."""

from loraplex.artifacts.digests import (
    Pieces,
    artifact_files,
    canonical_digest,
    check_digest,
    digest_and_pieces,
    is_artifact_name,
    read_artifact,
)
from loraplex.artifacts.errors import (
    ArtifactError,
    ArtifactUnavailable,
    DigestMismatch,
    UnsafeLocation,
)
from loraplex.artifacts.fetch import AllowList, Fetched, fetch_and_read, fetch_artifact
from loraplex.artifacts.oci import RegistryAuth, delete_pushed, is_oci_uri, push_artifact
from loraplex.artifacts.store import ArtifactStore, serve_store

__all__ = [
    "AllowList",
    "ArtifactError",
    "ArtifactStore",
    "ArtifactUnavailable",
    "DigestMismatch",
    "Fetched",
    "Pieces",
    "RegistryAuth",
    "UnsafeLocation",
    "artifact_files",
    "canonical_digest",
    "check_digest",
    "delete_pushed",
    "digest_and_pieces",
    "fetch_and_read",
    "fetch_artifact",
    "is_artifact_name",
    "is_oci_uri",
    "push_artifact",
    "read_artifact",
    "serve_store",
]
