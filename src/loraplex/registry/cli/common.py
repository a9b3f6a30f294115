"""What every `loraplex registry` command shares: the app, its options, opening the registry, and
errors as one line."""

from __future__ import annotations

import functools
import getpass
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from sqlalchemy.exc import SQLAlchemyError

from loraplex.artifacts import ArtifactError, ArtifactStore
from loraplex.model_config import ModelConfigError
from loraplex.registry.errors import AdapterRejected, RegistryError
from loraplex.registry.registry import Registry, default_store_for
from loraplex.registry.signing import load_public_key
from loraplex.registry.store import unreachable_store
from loraplex.settings.command import PlainTyper

# Help in click's plain layout (PLAIN): rich's tables cut long option names when piped or narrow.
app = PlainTyper(
    name="registry",
    help="Adapters, revisions, rollouts, tenants and keys.",
    no_args_is_help=True,
    add_completion=False,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The adapter name")]
RevisionArg = Annotated[str, typer.Argument(metavar="REVISION", help="The revision (r1, ...)")]
TenantArg = Annotated[str, typer.Argument(metavar="TENANT", help="The tenant")]


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "loraplex"


@dataclass(frozen=True)
class CliOptions:
    url: str
    store: Path
    storage_base: str | None
    trusted_keys: tuple[Path, ...]
    max_lora_rank: int
    store_given: bool = False
    """Whether --store named the store (a volume the workers mount, say) rather than the default."""

    def open(self, create: bool = False) -> Registry:
        """The registry; a SQLite file that is missing is made only with `create` (`init`)."""
        keys = tuple(load_public_key(p) for p in self.trusted_keys)
        return Registry(
            self.url,
            ArtifactStore(self.store),
            max_lora_rank=self.max_lora_rank,
            trusted_keys=keys,
            storage_base=self.storage_base,
            actor=getpass.getuser(),
            create=create,
        )

    def check_reachable_store(self) -> None:
        """Refuse to record revisions in this machine's default store while the registry is a
        server database: its workers elsewhere could never read a `file://` URI of this machine."""
        reason = unreachable_store(self.url, self.storage_base, self.store_given, self.store)
        if reason is not None:
            raise RegistryError(reason)

    def remote_copy_note(self) -> str | None:
        """For an http(s) or file --storage-base, where the files are and that add copies nothing
        there (an oci:// or s3:// one is uploaded to)."""
        if self.storage_base is None or self.storage_base.startswith(
            ("oci://", "oci+http://", "s3://")
        ):
            return None
        return (
            f"note: add copies nothing to {self.storage_base}: copy {self.store / 'sha256'} there "
            "before workers load these revisions"
        )


@app.callback()
def main(
    ctx: typer.Context,
    registry: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="Database URL: sqlite:///FILE or postgresql://... (default: "
            "sqlite:///DATA_DIR/registry.db)",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="Data directory (default: ~/.local/share/loraplex)"),
    ] = None,
    store: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Artifact store directory (default: artifacts/ beside a SQLite database, else "
            "DATA_DIR/artifacts); with a server database, a volume the workers mount at this path",
        ),
    ] = None,
    storage_base: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="Where workers read revisions: an OCI repository (oci://HOST/REPOSITORY; "
            "oci+http:// for plain http) or an S3 prefix (s3://BUCKET/PREFIX) add uploads to, or "
            "the http(s):// URL the store's sha256/ directory is copied to",
        ),
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="FILE",
            help="ed25519 public key (PEM); repeat; with any, unsigned revisions are refused",
        ),
    ] = None,
    max_lora_rank: Annotated[
        int, typer.Option(metavar="N", help="Refuse adapters of a higher rank")
    ] = 64,
):
    data = data_dir or default_data_dir()
    url = registry or f"sqlite:///{data / 'registry.db'}"
    default_store = default_store_for(url)
    store_dir = store or (default_store.root if default_store else data / "artifacts")
    ctx.obj = CliOptions(
        url, store_dir, storage_base, tuple(trusted_key or ()), max_lora_rank, store is not None
    )


def errors(command):
    """Print registry errors as one line on stderr and exit 1, instead of a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (
            RegistryError,
            ArtifactError,
            AdapterRejected,
            ModelConfigError,
            OSError,
            ValueError,
        ) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except (
            SQLAlchemyError
        ) as exc:  # not a registry file, an unknown URL, or another writer holding it
            reason = getattr(exc, "orig", None) or exc
            hint = "; another process is writing it, retry" if "locked" in str(reason) else ""
            typer.echo(
                f"error: the registry database: {str(reason).splitlines()[0]}{hint}", err=True
            )
            raise typer.Exit(1) from None
        except (
            ImportError,
            TypeError,
        ) as exc:  # a database driver not installed; a key file needing a password
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return run


def open_registry(ctx: typer.Context, create: bool = False) -> Registry:
    registry = ctx.obj.open(create)
    ctx.call_on_close(registry.close)
    return registry


def print_json(value) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))
