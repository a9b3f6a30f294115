"""Host memory that freed adapter copies leave behind, given back to the system.

glibc's allocator keeps the memory of freed chunks in each thread's arena for reuse; a host copy or
a read buffer of an adapter, freed on a load thread, so stays counted in the process's resident
memory until that thread allocates again. `release_freed` asks glibc to return every free page now
(`malloc_trim`); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed() -> bool:
    """Give the free pages of every arena back to the system; False where the allocator cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
