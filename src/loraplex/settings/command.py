"""A command made from a settings model: an option per setting, `--config FILE`, the environment,
`--print-config`, and `--help` with every option name whole at any width."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from loraplex.settings.fields import (
    Setting,
    SettingError,
    Sources,
    as_yaml_dict,
    resolve,
    settings_of,
    yaml_value,
)

PLAIN = None
"""A Typer app's `rich_markup_mode` for help in click's plain layout, every option name whole."""
EXTRA = "extra"
"""The hidden argument that takes a variadic option's further values."""


class PlainCommand(TyperCommand):
    """Help in click's plain layout: arguments under "Arguments" by their placeholder (NAME, or
    the metavar given), without typer's `<str>`, and in the usage line as they are typed."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                sections.setdefault("Arguments", []).append((_placeholder(param), param.help or ""))
                continue
            panel = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(panel, []).append(record)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        arguments = [
            _placeholder(p) if p.required else f"[{_placeholder(p)}]"
            for p in self.get_params(ctx)
            if p.param_type_name == "argument" and not getattr(p, "hidden", False) and p.name
        ]
        return ["[OPTIONS]", *arguments]


def _placeholder(argument: Any) -> str:
    name = argument.metavar or argument.name.upper()
    return name if argument.nargs == 1 or name.endswith("...") else f"{name}..."


class PlainTyper(typer.Typer):
    """A Typer app whose commands are PlainCommands, with help in click's plain layout."""

    def __init__(self, **kwargs: Any):
        super().__init__(rich_markup_mode=PLAIN, **kwargs)

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or PlainCommand, **kwargs)


class SettingsCommand(PlainCommand):
    """A command made from a settings model: its options in sections by panel."""


def add_settings_command(
    app: typer.Typer,
    model: type,
    run: Callable[[Any], None],
    name: str,
    env_prefix: str,
    arguments: tuple[tuple[str, str], ...] = (),
    check: Callable[[Any], None] | None = None,
) -> Callable[..., None]:
    """Adds the command `name` to `app`: it resolves `model` from defaults < `--config` <
    environment < flags and calls `run(settings)`; a bad value is one line on stderr and exit 2.
    The command's help is `run`'s docstring. `arguments`: (field, help) of the model's fields
    given as the command's positional arguments (required, not settings). `check(settings)`: what
    `--print-config` checks beyond the settings (the files and ports the command would use)."""
    specs = settings_of(model)

    def command(ctx: typer.Context, **given: Any) -> None:
        fixed = {field: given[field] for field, _ in arguments}
        try:
            settings = resolve(model, sources_from(ctx, specs, given, env_prefix), **fixed)
        except SettingError as exc:
            typer.echo(f"error: {exc}", err=True)
            sys.exit(2)
        if given["print_config"]:
            if check is not None:
                check(settings)
            typer.echo(dump_yaml(settings), nl=False)
            return
        run(settings)

    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    params += [
        _keyword(field, str, typer.Argument(help=text, show_default=False), default=...)
        for field, text in arguments
    ]
    params += [_parameter(s, env_prefix) for s in specs]
    params += _config_options()
    if any(s.spec.variadic for s in specs):
        params.append(_keyword(EXTRA, list[str] | None, typer.Argument(hidden=True)))
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__ = name
    help = inspect.getdoc(run)
    app.command(name, cls=SettingsCommand, help=help, context_settings=CONTEXT)(command)
    return command


def _config_options() -> list[inspect.Parameter]:
    """`--config FILE` and `--print-config`, which every settings command has."""
    return [
        _keyword(
            "config",
            str | None,
            typer.Option(
                metavar="FILE",
                help="YAML file of these settings by name (max-model-len: 4096); the "
                "environment and flags override it",
                rich_help_panel="Settings",
                show_default=False,
            ),
        ),
        _keyword(
            "print_config",
            bool,
            typer.Option(
                "--print-config",
                help="Print the resolved settings as YAML (a --config file) and exit",
                rich_help_panel="Settings",
                show_default=False,
            ),
            default=False,
        ),
    ]


CONTEXT = {"max_content_width": 100}


def _keyword(name: str, kind: Any, info: Any, default: Any = None) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, info]
    )


def _parameter(s: Setting, env_prefix: str) -> inspect.Parameter:
    """The setting's option. Every value is taken as text, so that a bad one gets the model's
    message, naming its source."""
    kind: Any = bool | None if s.is_flag else list[str] | None if s.multiple else str | None
    info = typer.Option(
        f"{s.flag}/--no-{s.flag[2:]}" if s.is_flag else s.flag,
        metavar=s.spec.metavar or metavar_of(s),
        help=_help(s, env_prefix),
        rich_help_panel=s.spec.panel,
        show_default=False,
    )
    return _keyword(s.name, kind, info)


def metavar_of(s: Setting) -> str:
    if s.spec.choices:
        return "|".join(s.spec.choices)
    if s.spec.unit == "size":
        return "SIZE"
    if s.kind is float:
        return "S" if s.name.endswith("_s") else "F"
    return {int: "N", Path: "PATH"}.get(s.kind, "TEXT")


def _help(s: Setting, env_prefix: str) -> str:
    default = default_text(s)
    parts = [s.spec.help]
    if default == "required":
        parts.append("[required]")
    elif default:
        parts.append(f"[default: {default}]")
    parts.append(f"[env: {s.env(env_prefix)}]")
    return " ".join(parts)


def default_text(s: Setting) -> str:
    """The default as help and docs state it ('' when there is none to state)."""
    if s.required:
        return "required"
    if s.spec.default_text:
        return s.spec.default_text
    value = yaml_value(s, s.default)
    if value is None or value == [] or value == {}:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


def sources_from(
    ctx: typer.Context, specs: tuple[Setting, ...], given: dict[str, Any], env_prefix: str
) -> Sources:
    """The file, the environment and the flags given on this command line."""
    flags = {
        s.name: list(given[s.name]) if s.multiple else given[s.name]
        for s in specs
        if getattr(ctx.get_parameter_source(s.name), "name", "") == "COMMANDLINE"
    }
    extra = list(given.get(EXTRA) or ())
    if extra:
        _spread(extra, flags, [s for s in specs if s.spec.variadic])
    path = given.get("config")
    return Sources(
        file=read_file(Path(path)) if path else None,
        file_name=str(path or ""),
        env=os.environ,
        env_prefix=env_prefix,
        flags=flags,
    )


def _spread(extra: list[str], flags: dict[str, Any], variadic: list[Setting]) -> None:
    """Values click left over: each goes to the variadic option it follows on the command line
    (`--lora-modules a=DIR b=DIR`): NAME=VALUE items to one taking them, others to one that does
    not (click keeps no order between options, so the form decides)."""
    for value in extra:
        for s in variadic:
            if s.name in flags and ("=" in value) == (s.spec.variadic == "pairs"):
                flags[s.name].append(value)
                break
        else:
            raise SettingError(f"unexpected argument {value!r}")


def read_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SettingError(f"--config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SettingError(f"--config {path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingError(f"--config {path}: expected a mapping of option names to values")
    return data


def dump_yaml(settings: Any) -> str:
    import yaml

    return yaml.safe_dump(as_yaml_dict(settings), sort_keys=False, default_flow_style=False)
