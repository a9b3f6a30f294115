"""Host memory that freed adapter copies leave behind, given back to the system, and the garbage
collector of a long-running server kept off what it started with.

glibc's allocator keeps the memory of freed chunks in each thread's arena for reuse; a host copy or
a read buffer of an adapter, freed on a load thread, so stays counted in the process's resident
memory until that thread allocates again. `release_freed` asks glibc to return every free page now
(`malloc_trim`); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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


def freeze_startup() -> None:
    """Keep what starting made (the libraries, the app, a catalog or a model: hundreds of thousands
    of objects, living as long as the process) out of the collector's view, and collect every
    10,000 net allocations rather than 700. A full collection, which requests' short-lived objects
    set off every few seconds, then scans only those and takes a millisecond, not tens of them or a
    third of a second (a stall of every request and streamed answer meanwhile); requests' objects
    are freed by their reference counts, so the rarer collections are enough for the cycles among
    them. At 700, collections ran about every 13 requests and cost a server 5% of its time."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
