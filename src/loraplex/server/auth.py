"""API keys → tenants (a keys file, or the registry's keys), and the admin token check."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from sqlalchemy.exc import DBAPIError

from loraplex.bearer import bearer, carries_token
from loraplex.registry import Registry
from loraplex.server.errors import APIError, unauthorized

log = logging.getLogger(__name__)

OPEN_TENANT = "default"
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MAX_CACHED_KEYS = 10_000


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_key_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(tenant, key) from a file of `TENANT KEY` lines (`#` starts a comment); also read by `bench
    serve`."""
    pairs = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _TENANT_RE.fullmatch(parts[0]):
            raise ValueError(f"{path} line {number}: expected `TENANT KEY`")
        if len(parts[1]) < 16:
            raise ValueError(f"{path} line {number}: the key is shorter than 16 characters")
        pairs.append((parts[0], parts[1]))
    return pairs


def read_api_keys(path: str | Path) -> dict[str, str]:
    """sha256(key) -> tenant from a file of `TENANT KEY` lines."""
    return {_hash(key): tenant for tenant, key in read_key_pairs(path)}


def read_admin_token(path: str | Path) -> str:
    lines = Path(path).read_text().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16:
        raise ValueError(f"{path}: the token on its first line must be at least 16 characters")
    return token


class Authenticator:
    """Tenant of a request. Open mode (tenant `default`) only while no key exists in the file or the
    registry.

    Registry answers are cached for `ttl_s`: a revoked key stops working, and a first key created in
    the registry closes open mode, within that time. Revoking every key does not reopen the server.
    While the registry's database cannot be reached, the last answers stand (a key never seen
    before cannot be checked: 500), so serving goes on through a restart of the database.
    """

    def __init__(
        self,
        registry: Registry,
        file_keys: dict[str, str] | None = None,
        ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = registry
        self.file_keys = file_keys or {}
        self.ttl_s = ttl_s
        self.clock = clock
        self._cache: dict[str, tuple[str | None, float]] = {}
        self._open: tuple[bool, float] | None = None

    def is_open(self) -> bool:
        """Open while no key was ever configured; once a key exists (even revoked later) it stays
        closed."""
        now = self.clock()
        if self._open is None or (self._open[0] and self._open[1] < now):
            try:
                is_open = not self.file_keys and not self.registry.list_keys()
            except DBAPIError as exc:
                if self._open is None:
                    raise
                self._unreachable(exc)
                return self._open[0]
            if self._open and not is_open:
                log.warning("API keys now exist: open mode is over, every request needs a key")
            self._open = (is_open, now + self.ttl_s)
        return self._open[0]

    async def tenant_of(self, authorization: str | None) -> str:
        """`tenant`, on a worker thread when it must ask the registry (a key not seen for `ttl_s`,
        open mode's look for a first key): never a query on the event loop."""
        if self._answers_from_memory(authorization):
            return self.tenant(authorization)
        return await asyncio.to_thread(self.tenant, authorization)

    def _answers_from_memory(self, authorization: str | None) -> bool:
        now = self.clock()
        if not self.file_keys and (self._open is None or (self._open[0] and self._open[1] < now)):
            return False  # open mode's look for a first key is due
        if self._open is not None and self._open[0]:
            return True
        key = bearer(authorization)
        if key is None:
            return True
        digest = _hash(key)
        cached = self._cache.get(digest)
        return digest in self.file_keys or (cached is not None and cached[1] >= now)

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant, or a 401 APIError."""
        if self.is_open():
            return OPEN_TENANT
        key = bearer(authorization)
        if key is None:
            raise unauthorized("No API key provided: send the header `Authorization: Bearer KEY`.")
        digest = _hash(key)
        tenant = self.file_keys.get(digest) or self._registry_tenant(key, digest)
        if tenant is None:
            raise unauthorized("Incorrect API key provided.")
        return tenant

    def _unreachable(self, exc: DBAPIError) -> None:
        log.warning("registry unreachable, the last answer on keys stands: %s", exc.orig)

    def forget(self) -> None:
        """The registry's keys changed: look each key up again at its next use."""
        self._cache = {}
        if self._open is not None and self._open[0]:
            self._open = None

    def _registry_tenant(self, key: str, digest: str) -> str | None:
        now = self.clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] >= now:
            return cached[0]
        try:
            tenant = self.registry.tenant_for_key(key)
        except DBAPIError as exc:
            if cached is None:
                raise
            self._unreachable(exc)
            return cached[0]
        if len(self._cache) >= _MAX_CACHED_KEYS:
            self._cache.clear()
        self._cache[digest] = (tenant, now + self.ttl_s)
        return tenant


def check_admin(authorization: str | None, token: str) -> None:
    """401 unless the request carries the admin token."""
    check_token(authorization, token, "admin")


def check_token(authorization: str | None, token: str, kind: str) -> None:
    """401 unless the request carries `token` (the admin or the metrics token)."""
    if not carries_token(authorization, token):
        raise APIError(
            401,
            f"This endpoint needs the {kind} token: send `Authorization: Bearer "
            f"{kind.upper()}_TOKEN`.",
            f"invalid_{kind}_token",
        )


def admin_router(token: str) -> APIRouter:
    """A router whose routes check the admin token before anything else: FastAPI reads and parses a
    route's body before it runs the route's dependencies, so a check there would let anyone make
    the server buffer a body of any size."""

    class AdminRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def guarded(request: Request):
                check_admin(request.headers.get("authorization"), token)
                return await handler(request)

            return guarded

    return APIRouter(route_class=AdminRoute)
