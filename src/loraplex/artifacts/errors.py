"""The errors of artifact I/O. Messages say what is wrong and what to do about it."""

from __future__ import annotations


class ArtifactError(Exception):
    """Base of the errors artifact I/O raises."""


class DigestMismatch(ArtifactError):
    """The bytes of an artifact do not hash to the digest they were asked for."""

    def __init__(self, expected: str, actual: str, where: str):
        super().__init__(f"digest mismatch for {where}: expected {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


class ArtifactUnavailable(ArtifactError):
    """The artifact could not be read or downloaded (store down, timeout, missing)."""


class UnsafeLocation(ArtifactError):
    """A storage URI or file name outside the operator's allowlist, or a path that escapes its
    root."""
