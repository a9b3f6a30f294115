"""Freed host memory goes back to the system where the allocator can give it (glibc on Linux)."""

import platform
import threading

import pytest

from loraplex.host_memory import release_freed


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_memory_freed_on_a_thread_leaves_the_process_once_released():
    kept: list[bytearray] = []

    def load():
        # 64 KiB pieces (under glibc's mmap threshold: they live in this thread's arena), every
        # other one kept: what is freed cannot merge into a top chunk the arena trims by itself
        pieces = [bytearray(64 << 10) for _ in range(2048)]
        kept.extend(pieces[1::2])
        del pieces

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    before = resident_bytes()
    assert release_freed()
    assert before - resident_bytes() > 32 << 20  # most of the 64 MiB freed
