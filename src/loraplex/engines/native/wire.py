"""The messages between the API server and the engine process: msgpack, with loraplex's dataclasses,
paths, tuples, sets, enums and exceptions as extension types. Only classes of loraplex (and builtin
exceptions) are rebuilt on decoding; another exception arrives as a RuntimeError with its text.

Requests repeat the same adapter refs and sampling parameters: an immutable dataclass (frozen,
compared by value, hashable) is encoded once per distinct value and decoded once per distinct
bytes, and a value equal to one sent before goes as that one."""

from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import importlib
from pathlib import Path
from typing import NamedTuple

import msgpack

_DATACLASS, _PATH, _TUPLE, _SET, _FROZENSET, _ENUM, _EXCEPTION, _VALUE = range(1, 9)


def encode(obj) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def decode(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def rows(items: list) -> list[list]:
    """Dataclass instances of one class as lists of their field values, in field order: the step
    messages' outputs, far cheaper to send than one extension type each."""
    if not items:
        return []
    names = _fields(type(items[0])).names
    return [[getattr(item, name) for name in names] for item in items]


def from_rows(cls: type, values: list[list]) -> list:
    """The instances `rows` gave the values of (every field of `cls` set by its constructor)."""
    return [cls(*row) for row in values]


def _pack(obj) -> bytes:
    return encode(obj)


def _name(cls: type) -> list[str]:
    return [cls.__module__, cls.__qualname__]


def _default(obj):
    # enums and str/int subclasses before the plain types: strict_types sends them here
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(_ENUM, _pack([*_name(type(obj)), obj.value]))
    fields = _fields(type(obj))
    if fields is not None:
        if fields.is_value:
            try:
                return _value_ext(obj, tuple(getattr(obj, name) for name in fields.hidden))
            except TypeError:  # not hashable after all: a field holds a list or a dict
                pass
        return msgpack.ExtType(_DATACLASS, _dataclass_bytes(obj, fields))
    if isinstance(obj, BaseException):
        attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_") and _sendable(v)}
        return msgpack.ExtType(_EXCEPTION, _pack([*_name(type(obj)), list(obj.args), attrs]))
    if isinstance(obj, Path):
        return msgpack.ExtType(_PATH, str(obj).encode())
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, frozenset):
        return msgpack.ExtType(_FROZENSET, _pack(list(obj)))
    if isinstance(obj, set):
        return msgpack.ExtType(_SET, _pack(list(obj)))
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to or from the engine process")


class _Fields(NamedTuple):
    class_name: list[str]
    names: tuple[str, ...]
    init: frozenset[str]
    """The fields the constructor takes; the others are set after it."""
    is_value: bool
    """Frozen and compared by value."""
    hidden: tuple[str, ...]
    """The fields left out of comparisons (and so out of the hash)."""


@functools.lru_cache(maxsize=256)
def _fields(cls: type) -> _Fields | None:
    """A dataclass's fields, looked up once per class (every request and output is one)."""
    if not dataclasses.is_dataclass(cls):
        return None
    fields = dataclasses.fields(cls)
    init = frozenset(f.name for f in fields if f.init)
    params = cls.__dataclass_params__
    hidden = tuple(f.name for f in fields if not f.compare)
    return _Fields(
        _name(cls), tuple(f.name for f in fields), init, params.frozen and params.eq, hidden
    )


def _dataclass_bytes(obj, fields: _Fields) -> bytes:
    return _pack([*fields.class_name, {name: getattr(obj, name) for name in fields.names}])


@functools.lru_cache(maxsize=1024)
def _value_ext(obj, hidden: tuple) -> msgpack.ExtType:
    """An immutable dataclass's encoding; `hidden`: the values of its fields that its hash leaves
    out, part of what is looked up."""
    return msgpack.ExtType(_VALUE, _dataclass_bytes(obj, _fields(type(obj))))


@functools.lru_cache(maxsize=1024)
def _value(data: bytes):
    """An immutable dataclass from its encoding: the same object for the same bytes."""
    return _ext_hook(_DATACLASS, data)


def _sendable(value) -> bool:
    """An exception's attribute that cannot be encoded stays behind; its message still goes."""
    try:
        encode(value)
    except (TypeError, ValueError):
        return False
    return True


def _ext_hook(code: int, data: bytes):
    if code == _VALUE:
        return _value(data)
    if code == _PATH:
        return Path(data.decode())
    value = decode(data)
    if code == _TUPLE:
        return tuple(value)
    if code == _SET:
        return set(value)
    if code == _FROZENSET:
        return frozenset(value)
    if code == _ENUM:
        module, name, member = value
        return _class(module, name)(member)
    if code == _DATACLASS:
        module, name, values = value
        return _dataclass(_class(module, name), values)
    if code == _EXCEPTION:
        return _exception(*value)
    return msgpack.ExtType(code, data)


@functools.lru_cache(maxsize=256)
def _class(module: str, name: str) -> type:
    if module.split(".")[0] != "loraplex":
        raise TypeError(f"{module}.{name} is not a loraplex type")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _dataclass(cls: type, values: dict):
    fields = _fields(cls)
    if fields is None:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not a dataclass")
    init = fields.init
    obj = cls(**{k: v for k, v in values.items() if k in init})
    for k, v in values.items():
        if k not in init:
            object.__setattr__(obj, k, v)
    return obj


def _exception(module: str, name: str, args: list, attrs: dict) -> BaseException:
    """The same exception class where it is ours or a builtin one (so that the server maps it to
    the same HTTP answer), its args and attributes set without calling its constructor."""
    if module == "builtins" and isinstance(getattr(builtins, name, None), type):
        cls = getattr(builtins, name)
    else:
        try:
            cls = _class(module, name)
        except (TypeError, ImportError, AttributeError):
            return RuntimeError(*args)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return RuntimeError(*args)
    exc = cls.__new__(cls)
    exc.args = tuple(args)
    vars(exc).update(attrs)
    return exc
