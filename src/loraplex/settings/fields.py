"""Declaring settings (`setting`, checks) and resolving them from their sources: the defaults, a
YAML file, the environment and the command line, in that order of precedence."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.units import format_size, parse_size

Check = Callable[[Any], str | None]
"""A field's check: None when the value is good, else what is wrong ("must be at least 1")."""


class SettingError(ValueError):
    """A bad value, with where it came from; its message is the one line a command prints."""


@dataclass(frozen=True)
class Spec:
    help: str
    """One line for `--help`."""
    panel: str = "Options"
    """The section of `--help` and of the docs the setting is listed in."""
    doc: str = ""
    """The docs table's longer text (default: the help)."""
    default_text: str = ""
    """What the docs and `--help` say of a default that is computed (None as a value)."""
    unit: str = ""
    """`size`: bytes, written as `512MiB` or `4GiB` too."""
    choices: tuple[str, ...] = ()
    check: Check | None = None
    parse: Callable[[Any], Any] | None = None
    """A value from its text or YAML form, for types that are not plain (raises ValueError)."""
    show: Callable[[Any], Any] | None = None
    """The YAML form of a value that `parse` reads back (`--print-config`)."""
    variadic: str = ""
    """vLLM-style, several values after one flag: `pairs` (`--lora-modules a=DIR b=DIR`) or
    `values` (`--allowed-roots D1 D2`)."""
    metavar: str = ""
    schema: Mapping[str, Any] | None = None
    """The JSON Schema of the values `parse` reads (the Helm chart's `worker.serve`)."""
    default_from: Callable[[Any], Any] | None = None
    """The default that the other settings give a None (`--print-config` shows it)."""


SPEC = "loraplex.setting"


def setting(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:
    """A settings field: its default and its `Spec`."""
    return field(default=default, metadata={SPEC: Spec(help=help, **spec)})


@dataclass(frozen=True)
class Bounds:
    """A check that a number lies in a range; the chart's schema states the same range."""

    message: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def __call__(self, v: float) -> str | None:
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or v <= self.high
        return None if above and below else self.message  # NaN fails both

    def schema(self) -> dict[str, float]:
        """The range as JSON Schema keywords."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


def at_least(low: float) -> Bounds:
    return Bounds(f"must be at least {low:g}", low)


def within(low: int, high: int) -> Bounds:
    return Bounds(f"must be in [{low}, {high}]", low, high)


@dataclass(frozen=True)
class Matches:
    """A check that a text matches a pattern (JSON Schema's dialect, which Python reads too)."""

    message: str
    pattern: str

    def __call__(self, v: str) -> str | None:
        return None if re.search(self.pattern, v) else self.message

    def schema(self) -> dict[str, str]:
        return {"pattern": self.pattern}


positive = Bounds("must be positive", 0, low_open=True)
share = Bounds("must be a share in [0, 1]", 0, 1)
open_share = Bounds("must be a share in (0, 1]", 0, 1, low_open=True)
port_number = within(0, 65535)


class Conflict(ValueError):
    """Settings that do not go together; `names` are theirs, so the message can say where each
    value came from."""

    def __init__(self, message: str, *names: str):
        super().__init__(message)
        self.names = names


def weights(
    names: Mapping[str, str] | None,
    minimum: float | None = None,
    *,
    label: str = "NAME",
    above: float | None = None,
) -> Callable[[Any], Any]:
    """A reader of `NAME=W,...` (a flag, a variable, repeated flags) or a YAML mapping of the
    same: `((name, weight), ...)`. `names`: the short names allowed (None: any name); each weight at
    least `minimum`, or above `above`."""

    def parse(raw: Any) -> tuple[tuple[str, float], ...]:
        if isinstance(raw, dict):
            raw = ",".join(f"{k}={v}" for k, v in raw.items())
        if isinstance(raw, list | tuple):
            raw = ",".join(map(str, raw))
        out = []
        for part in filter(None, (p.strip() for p in str(raw).split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or not name or (names is not None and name not in names):
                allowed = f", {label} one of {', '.join(names)}" if names is not None else ""
                raise ValueError(f"{part!r}: expected {label}=WEIGHT{allowed}")
            try:
                weight = float(value)
            except ValueError:
                raise ValueError(f"{part!r}: {value!r} is not a number") from None
            if not math.isfinite(weight):
                raise ValueError(f"{part!r}: {value!r} is not a finite number")
            if minimum is not None and weight < minimum:
                raise ValueError(f"{part!r}: a weight must be >= {minimum:g}")
            if above is not None and not weight > above:
                raise ValueError(f"{part!r}: a weight must be above {above:g}")
            out.append((name, weight))
        return tuple(out)

    return parse


@dataclass(frozen=True)
class Setting:
    """One declared field, read for what the resolver, the command and the docs need."""

    name: str
    spec: Spec
    kind: type
    """The value's plain type (of each item, for a tuple)."""
    optional: bool
    multiple: bool
    default: Any
    required: bool

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """Its `--config` key."""
        return self.name.replace("_", "-")

    def env(self, prefix: str) -> str:
        return prefix + self.name.upper()

    @property
    def is_flag(self) -> bool:
        return self.kind is bool and not self.multiple


@functools.cache
def settings_of(model: type) -> tuple[Setting, ...]:
    """A model's settings, read once per model (configurations check theirs as they are built)."""
    hints = typing.get_type_hints(model)
    out = []
    for f in dataclasses.fields(model):
        spec = f.metadata.get(SPEC)
        if spec is None:
            continue
        kind, optional, multiple = _plain(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else f.default
        out.append(Setting(f.name, spec, kind, optional, multiple, default, required))
    return tuple(out)


def _plain(hint: Any) -> tuple[type, bool, bool]:
    """(item type, optional, multiple) of `int`, `int | None`, `tuple[Path, ...]`, ..."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


def check_fields(config: Any, model: type) -> None:
    """The checks `model` declares, applied to the same-named fields of another configuration
    (an engine's): ValueError naming the field."""
    for s in settings_of(model):
        problem = problem_of(s, getattr(config, s.name, None))
        if problem:
            raise ValueError(f"{s.name} {problem}")


def same_named(config: type, settings: Any) -> dict[str, Any]:
    """The values of `settings` whose names are fields of the dataclass `config` (an engine's
    configuration): what it takes under the settings' own names."""
    names = {f.name for f in dataclasses.fields(config)}
    mine = (s.name for s in settings_of(type(settings)) if s.name in names)
    return {name: getattr(settings, name) for name in mine}


# ---- values from text or YAML --------------------------------------------------------------


def convert(s: Setting, raw: Any) -> Any:
    """The typed value of a setting from a flag's or a variable's text or a YAML value; ValueError
    saying what is wrong with it."""
    if s.spec.parse is not None:
        value = s.spec.parse(raw)
    elif s.multiple:
        items = raw.split() if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            items = [items]
        value = tuple(_item(s, item) for item in items)
    elif raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "~")):
        if not s.optional:
            raise ValueError("a value is required")
        return None
    else:
        value = _item(s, raw)
    return value


def problem_of(s: Setting, value: Any) -> str | None:
    """What the setting's check finds wrong with a value (None: nothing)."""
    if value is None or s.multiple:
        return None
    if s.spec.choices and value not in s.spec.choices:
        return f"{value}: use {' | '.join(s.spec.choices)}"
    problem = s.spec.check(value) if s.spec.check is not None else None
    return f"{shown(s, value)}: {problem}" if problem else None


def _item(s: Setting, raw: Any) -> Any:
    if isinstance(raw, dict | list):
        raise ValueError(f"expected one value, not {type(raw).__name__} {raw!r}")
    kind = s.kind
    if s.spec.unit == "size":
        return parse_size(raw if isinstance(raw, int) and not isinstance(raw, bool) else str(raw))
    if kind is bool:
        return _bool(raw)
    if kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"{raw!r} is not an integer")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
    if kind is float:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{raw!r} is not a number") from None
        if math.isnan(value) or isinstance(raw, bool):
            raise ValueError(f"{raw!r} is not a number")
        return value
    text = str(raw)
    return Path(text) if kind is Path else text


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def shown(s: Setting, value: Any) -> str:
    """A value as a flag would give it."""
    if s.spec.unit == "size":
        return format_size(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def yaml_value(s: Setting, value: Any) -> Any:
    """A value as `--print-config` writes it (`convert` reads it back)."""
    if value is None:
        return None
    if s.spec.show is not None:
        return s.spec.show(value)
    if s.multiple:
        return [str(v) if isinstance(v, Path) else v for v in value]
    if s.spec.unit == "size":
        return format_size(value)
    return str(value) if isinstance(value, Path) else value


# ---- resolution -----------------------------------------------------------------------------


@dataclass
class Sources:
    """Where each value comes from, lowest precedence first."""

    file: Mapping[str, Any] | None = None
    file_name: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    env_prefix: str = "LORAPLEX_"
    flags: Mapping[str, Any] = field(default_factory=dict)
    """Setting name -> the text (or texts) given on the command line."""


def resolve(model: type, sources: Sources, **fixed: Any) -> Any:
    """An instance of `model` from its sources: defaults < file < environment < flags; `fixed`
    values (computed by the command) go in as they are. SettingError names the setting and the
    source of a bad value."""
    by_name = {s.name: s for s in settings_of(model)}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if sources.file is not None:
        by_key = {s.key: s for s in by_name.values()}
        keys: dict[str, Any] = {}
        for key, raw in sources.file.items():
            s = by_key.get(str(key).removeprefix("--").replace("_", "-"))
            where = f"--config {sources.file_name}: key {key!r}:"
            if s is None:
                raise SettingError(
                    f"--config {sources.file_name}: unknown key {key!r} (the keys are the "
                    "option names, e.g. max-model-len)"
                )
            if s.name in keys:
                raise SettingError(
                    f"--config {sources.file_name}: keys {keys[s.name]!r} and {key!r} are one "
                    "setting; give it once"
                )
            keys[s.name] = key
            values[s.name] = _convert(s, raw, where)
            origin[s.name] = f"--config {sources.file_name}"
    for s in by_name.values():
        name = s.env(sources.env_prefix)
        if name in sources.env:
            raw = sources.env[name]
            values[s.name] = _convert(s, raw, f"{name} (environment):")
            origin[s.name] = name
    for name, raw in sources.flags.items():
        s = by_name[name]
        values[name] = _convert(s, raw, s.flag)
        origin[name] = "the command line"
    missing = [s.flag for s in by_name.values() if s.required and s.name not in values]
    if missing:
        raise SettingError(f"{missing[0]} is required")
    try:
        return model(**values, **fixed)
    except SettingError:
        raise
    except Conflict as exc:
        given = "; ".join(f"{by_name[n].flag}: {origin.get(n, 'the default')}" for n in exc.names)
        raise SettingError(f"{exc} ({given})") from None
    except ValueError as exc:  # a check across settings
        raise SettingError(str(exc)) from None


def _convert(s: Setting, raw: Any, where: str) -> Any:
    """`where`: the source, ending in a colon for a file or a variable, a bare flag otherwise."""
    try:
        value = convert(s, raw)
    except ValueError as exc:
        raise SettingError(f"{where.removesuffix(':')}: {exc}") from None
    problem = problem_of(s, value)
    if problem:
        raise SettingError(f"{where} {problem}")
    return value


def as_yaml_dict(settings: Any) -> dict[str, Any]:
    """Every setting of an instance by its `--config` key, as `--print-config` writes them."""
    return {s.key: yaml_value(s, resolved(s, settings)) for s in settings_of(type(settings))}


def resolved(s: Setting, settings: Any) -> Any:
    """A setting's value, or the default the other settings give its None."""
    value = getattr(settings, s.name)
    if value is None and s.spec.default_from is not None:
        return s.spec.default_from(settings)
    return value
