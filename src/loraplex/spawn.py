"""Starting child processes with multiprocessing's spawn without the parent's main module."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def without_main_module() -> Iterator[None]:
    """While spawn children start (the native engine process, vLLM's engine core): spawn runs
    the parent's `__main__` again in each child, for what was pickled from it, and under
    `loraplex serve` that is `loraplex.cli` with every command's imports (about 1.6 s of CPU per
    child). The children's targets live in importable modules, so they need none of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
