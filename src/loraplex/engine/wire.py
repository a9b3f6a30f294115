"""The messages between the API server and the engine process: msgpack, with loraplex's dataclasses,
paths, tuples, sets, enums and exceptions as extension types. Only classes of loraplex (and builtin
exceptions) are rebuilt on decoding; another exception arrives as a RuntimeError with its text."""

from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import importlib
from pathlib import Path

import msgpack

_DATACLASS, _PATH, _TUPLE, _SET, _FROZENSET, _ENUM, _EXCEPTION = range(1, 8)


def encode(obj) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def decode(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _pack(obj) -> bytes:
    return encode(obj)


def _name(cls: type) -> list[str]:
    return [cls.__module__, cls.__qualname__]


def _default(obj):
    # enums and str/int subclasses before the plain types: strict_types sends them here
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(_ENUM, _pack([*_name(type(obj)), obj.value]))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_DATACLASS, _pack([*_name(type(obj)), values]))
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


def _sendable(value) -> bool:
    """An exception's attribute that cannot be encoded stays behind; its message still goes."""
    try:
        encode(value)
    except (TypeError, ValueError):
        return False
    return True


def _ext_hook(code: int, data: bytes):
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
    init = {f.name for f in dataclasses.fields(cls) if f.init}
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
