"""Ed25519 signatures over an artifact's digest: the signed message is the ASCII text
`sha256:<hex>`.

A signature is written `ed25519:<base64 of the 64 signature bytes>`; keys are PEM files.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraplex.registry.errors import AdapterRejected

PREFIX = "ed25519:"
SIGNATURE_FILE = "adapter.sig"
"""A detached signature beside an adapter's files (not one of them: the digest leaves it out), read
when a registration gives no signature of its own (`serve --lora-modules`,
`/v1/load_lora_adapter`)."""


def generate_keypair() -> tuple[bytes, bytes]:
    """(private key PEM, public key PEM) for a new ed25519 key."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private, public


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an ed25519 public key")
    return key


def sign_digest(digest: str, key: Ed25519PrivateKey) -> str:
    return PREFIX + base64.b64encode(key.sign(digest.encode())).decode()


def verify_digest(
    digest: str, signature: str | None, trusted: tuple[Ed25519PublicKey, ...]
) -> None:
    """Raise AdapterRejected("signature", ...) unless a trusted key signed `digest`."""
    if not signature:
        raise AdapterRejected(
            "signature", "the revision is unsigned and trusted keys are configured"
        )
    if not signature.startswith(PREFIX):
        raise AdapterRejected("signature", f"unknown signature format (expected {PREFIX}<base64>)")
    try:
        raw = base64.b64decode(signature.removeprefix(PREFIX), validate=True)
    except binascii.Error:
        raise AdapterRejected("signature", "the signature is not valid base64") from None
    for key in trusted:
        try:
            key.verify(raw, digest.encode())
            return
        except InvalidSignature:
            continue
    raise AdapterRejected("signature", f"no trusted key signed {digest}")


def read_signature_file(directory: str | Path) -> str | None:
    """The signature in DIR/adapter.sig, None without one."""
    path = Path(directory) / SIGNATURE_FILE
    return path.read_text().strip() or None if path.is_file() else None
