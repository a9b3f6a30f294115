"""`loraplex registry export ...`: the registry as another system's configuration."""

from __future__ import annotations

from typing import Annotated

import typer

from loraplex.registry.cli.common import app, errors, open_registry
from loraplex.settings.command import PlainTyper

export_app = PlainTyper(
    help="The registry as another system's configuration.",
    no_args_is_help=True,
)
app.add_typer(export_app, name="export")


@export_app.command("k8s")
@errors
def export_k8s(
    ctx: typer.Context,
    pool: Annotated[
        str, typer.Option(metavar="NAME", help="InferencePool the rewrites apply to")
    ] = "loraplex",
    namespace: Annotated[
        str | None, typer.Option(metavar="NAMESPACE", help="Namespace of the objects")
    ] = None,
):
    """Print one InferenceModelRewrite per adapter name with traffic (YAML for `kubectl apply`)."""
    import yaml

    from loraplex.registry.k8s import check_names, model_rewrites

    check_names(pool, namespace)
    objects = model_rewrites(open_registry(ctx).list_adapters(), pool, namespace)
    typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)
