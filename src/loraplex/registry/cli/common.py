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
from loraplex.settings.command import PLAIN

# Help in click's plain layout (PLAIN): rich's tables cut long option names when piped or narrow.
app = typer.Typer(
    name="registry",
    help="Adapters, revisions, rollouts, tenants and keys.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=PLAIN,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "loraplex"


@dataclass(frozen=True)
class CliOptions:
    url: str
    store: Path
    storage_base: str | None
    trusted_keys: tuple[Path, ...]
    max_lora_rank: int

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


@app.callback()
def main(
    ctx: typer.Context,
    registry: Annotated[
        str | None, typer.Option(help="Database URL (default: sqlite:///DATA_DIR/registry.db)")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data directory (default: ~/.local/share/loraplex)")
    ] = None,
    store: Annotated[
        Path | None, typer.Option(help="Artifact store (default: artifacts/ beside the database)")
    ] = None,
    storage_base: Annotated[
        str | None,
        typer.Option(
            help="URL the store is served under (http store), or an OCI repository the revisions "
            "are pushed to (oci://HOST/REPOSITORY; oci+http:// for plain http)"
        ),
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(
            help="ed25519 public key (PEM); repeat; with any, unsigned revisions are refused"
        ),
    ] = None,
    max_lora_rank: Annotated[int, typer.Option(help="Refuse adapters of a higher rank")] = 64,
):
    data = data_dir or default_data_dir()
    url = registry or f"sqlite:///{data / 'registry.db'}"
    default_store = default_store_for(url)
    store_dir = store or (default_store.root if default_store else data / "artifacts")
    ctx.obj = CliOptions(url, store_dir, storage_base, tuple(trusted_key or ()), max_lora_rank)


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
