"""The cache's errors; the server maps them to HTTP codes in one place."""


class AdapterUnavailable(RuntimeError):
    """The adapter could not be made resident (bad file, digest mismatch, store down); the message
    says why, for the log. `public` is what a client is told: the cause's details (paths, URLs) are
    the operator's, not a tenant's."""

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public or message


class AdapterInFlight(RuntimeError):
    """The adapter has running or admitted requests, so it cannot be evicted now."""


class CapacityExceeded(RuntimeError):
    """A pin or prewarm asks for more than the tier holds."""


class ArtifactCorrupt(AdapterUnavailable):
    """The adapter's bytes do not hash to its digest: never serve that revision (the server
    quarantines it)."""
