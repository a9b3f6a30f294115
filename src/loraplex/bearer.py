"""The bearer token of an `Authorization` header, and the check of a configured token against it.

Shared by the server and the router (which talks HTTP only and imports nothing of the server).
"""

from __future__ import annotations

import hmac


def bearer(authorization: str | None) -> str | None:
    """The token of `Bearer TOKEN` (the scheme in any case); None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def carries_token(authorization: str | None, token: str) -> bool:
    """The header carries `token`, compared in constant time."""
    given = bearer(authorization)
    # bytes: compare_digest refuses a str with non-ASCII characters, which anyone can send
    return given is not None and hmac.compare_digest(given.encode(), token.encode())
