"""The disk tier: a local content-addressed artifact cache with a byte budget, filled from the
remote store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.artifacts import (
    AllowList,
    ArtifactStore,
    DigestMismatch,
    Pieces,
    fetch_and_read,
    read_artifact,
)


class DiskTier:
    def __init__(self, root: Path, max_bytes: int, allowed: AllowList, timeout_s: float = 30.0):
        self.store = ArtifactStore(root)
        self.max_bytes = max_bytes
        self.allowed = allowed
        self.timeout_s = timeout_s
        self._last_use: dict[str, float] = {d: 0.0 for d in self.store.digests()}
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()
        self._http = (
            None  # one httpx.Client for every download: keeps connections, loads the CA bundle once
        )

    def has(self, digest: str) -> bool:
        return self.store.has(digest)

    def read(
        self,
        storage_uri: str,
        digest: str,
        use: Callable | None = None,
        pieces: Pieces | None = None,
    ) -> tuple[Any, float | None]:
        """The artifact's digest-checked bytes (or what `use` made of them, as in `read_artifact`;
        checked by the registry's `pieces` when given), from the local copy or downloaded first; and
        the seconds the download took (None: read from the local copy). A damaged local copy is
        dropped and downloaded again, never used."""
        with self._lock:
            self._in_use[digest] = self._in_use.get(digest, 0) + 1
        try:
            found, result = self._read_local(digest, use, pieces)
            download_s = None
            if not found:
                # downloaded, then checked and used in one read (not read again from disk)
                fetched = fetch_and_read(
                    storage_uri,
                    digest,
                    self.store,
                    self.allowed,
                    use,
                    timeout_s=self.timeout_s,
                    http_client=self._http_client(storage_uri),
                    pieces=pieces,
                )
                result, download_s = fetched.result, fetched.download_s
            with self._lock:
                self._last_use[digest] = time.monotonic()
            return result, download_s
        finally:
            with self._lock:
                self._in_use[digest] -= 1
            self.shrink()

    def _http_client(self, uri: str):
        if not uri.startswith(("http://", "https://")):
            return None
        with self._lock:
            if self._http is None:
                import httpx  # only http stores need it

                self._http = httpx.Client(timeout=self.timeout_s, follow_redirects=False)
            return self._http

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    def _read_local(
        self, digest: str, use: Callable | None, pieces: Pieces | None
    ) -> tuple[bool, object]:
        """(whether a sound local copy was there, what reading it gave)."""
        if not self.store.has(digest):
            return False, None
        try:
            return True, read_artifact(self.store.path(digest), digest, use, pieces)
        except DigestMismatch:
            self.store.remove(digest)
            return False, None

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
