"""The bearer token of an `Authorization` header, and the check of a configured token against it.

Shared by the server and the router (which talks HTTP only and imports nothing of the server).
"""

from __future__ import annotations

import base64
import binascii
import hmac


def bearer(authorization: str | None) -> str | None:
    """The token of `Bearer TOKEN` (the scheme in any case); None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def basic_password(authorization: str | None) -> str | None:
    """The password of `Basic base64(USER:PASSWORD)`; None without one."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return (password or None) if colon else None


def carries_token(authorization: str | None, token: str) -> bool:
    """The header carries `token`, compared in constant time: as `Bearer TOKEN`, or as the password
    of HTTP Basic authentication (any user name), which clients that read ~/.netrc send (Python's
    `requests` does, for a client that sets no header of its own, such as TRL's)."""
    given = bearer(authorization) or basic_password(authorization)
    # bytes: compare_digest refuses a str with non-ASCII characters, which anyone can send
    return given is not None and hmac.compare_digest(given.encode(), token.encode())
