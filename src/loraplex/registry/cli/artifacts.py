"""`loraplex registry` commands over artifacts and signing keys: digest, sign, keygen, gc."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loraplex.artifacts import canonical_digest
from loraplex.registry.cli.common import app, errors, open_registry
from loraplex.registry.signing import generate_keypair, load_private_key, sign_digest

_Dir = Annotated[Path, typer.Argument(metavar="DIR", help="The adapter directory")]


@app.command()
@errors
def digest(directory: _Dir):
    """Print the canonical digest of an adapter directory."""
    typer.echo(canonical_digest(directory))


@app.command()
@errors
def sign(
    directory: _Dir,
    key: Annotated[Path, typer.Option(metavar="FILE", help="ed25519 private key (PEM)")],
):
    """Print the signature of an adapter directory's digest, for `add --signature`."""
    typer.echo(sign_digest(canonical_digest(directory), load_private_key(key)))


@app.command()
@errors
def keygen(
    private_out: Annotated[
        Path, typer.Argument(metavar="PRIVATE_PEM", help="The private key's file (mode 0600)")
    ],
    public_out: Annotated[Path, typer.Argument(metavar="PUBLIC_PEM", help="The public key's file")],
):
    """Write a new ed25519 key pair (PEM) for signing revisions."""
    private, public = generate_keypair()
    private_out.touch(mode=0o600)
    private_out.write_bytes(private)
    public_out.write_bytes(public)
    typer.echo(f"wrote {private_out} (keep it secret) and {public_out} (give it to --trusted-key)")


@app.command()
@errors
def gc(
    ctx: typer.Context,
    min_age_s: Annotated[
        float,
        typer.Option(
            metavar="S", help="Keep entries no revision refers to while younger than this (s)"
        ),
    ] = 3600,
):
    """Delete the artifacts of retired revisions that no other revision refers to, and those no
    revision refers to (left by refused or interrupted registrations) once old enough."""
    removed = open_registry(ctx).gc_artifacts(min_age_s)
    typer.echo(f"removed {len(removed)} artifact(s)")
