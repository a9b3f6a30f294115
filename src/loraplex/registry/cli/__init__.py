"""`loraplex registry ...`: the operator's commands over the registry (a typer sub-app)."""

# isort: off
# Each module adds its commands to `app` as it is imported: this order is the order of `--help`.
from loraplex.registry.cli.common import app, default_data_dir
from loraplex.registry.cli import adapters, lifecycle, artifacts, tenants, export  # noqa: F401
from loraplex.registry.cli import parity  # noqa: F401

# isort: on

__all__ = ["app", "default_data_dir"]
