"""The disk tier: a local content-addressed artifact cache with a byte budget, filled from the remote store."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from loraplex.registry.store import AllowList, ArtifactStore, fetch_artifact


class DiskTier:
    def __init__(self, root: Path, max_bytes: int, allowed: AllowList, timeout_s: float = 30.0):
        self.store = ArtifactStore(root)
        self.max_bytes = max_bytes
        self.allowed = allowed
        self.timeout_s = timeout_s
        self._last_use: dict[str, float] = {d: 0.0 for d in self.store.digests()}
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()

    def has(self, digest: str) -> bool:
        return self.store.has(digest)

    @contextlib.contextmanager
    def use(self, storage_uri: str, digest: str) -> Iterator[tuple[Path, bool]]:
        """A verified local directory for the artifact (kept while in the block), and whether it was downloaded."""
        with self._lock:
            self._in_use[digest] = self._in_use.get(digest, 0) + 1
        try:
            downloaded = not self.store.has(digest)
            path = fetch_artifact(storage_uri, digest, self.store, self.allowed, timeout_s=self.timeout_s)
            with self._lock:
                self._last_use[digest] = time.monotonic()
            yield path, downloaded
        finally:
            with self._lock:
                self._in_use[digest] -= 1
            self.shrink()

    def used_bytes(self) -> int:
        return sum(self.store.size(d) for d in self.store.digests())

    def shrink(self) -> list[str]:
        """Drop least recently used artifacts (never one being read) until within budget."""
        removed = []
        with self._lock:
            sizes = {d: self.store.size(d) for d in self.store.digests()}
            total = sum(sizes.values())
            for digest in sorted(sizes, key=lambda d: self._last_use.get(d, 0.0)):
                if total <= self.max_bytes:
                    break
                if self._in_use.get(digest):
                    continue
                self.store.remove(digest)
                self._last_use.pop(digest, None)
                total -= sizes[digest]
                removed.append(digest)
        return removed
