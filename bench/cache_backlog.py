"""What the cache's `acquire` costs the step loop with many requests waiting: microseconds per call
as the number of waiting requests grows.

    python bench/cache_backlog.py [--waiting 100,250,500,1000]
        [--json bench/results/cache_backlog.json]

The real `Residency` on the native backend (`score`) with the fake slot pool and executor of the
cache tests (no torch): 2,000 adapters seen, one slot held by a running request, host memory for 50
copies (`max_cpu_loras` 50) all asked for by waiting requests, and N more waiting requests whose
adapters are not in host memory (their loads wait for room). The engine's scheduler calls `acquire`
for every waiting request at every step, so a step's scheduling costs N times the figure here; a
cost per call that grows with N makes the steps quadratic in the waiting requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loraplex.engines.native.slots import Loaded, native_residency
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import ScorePolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cache"))
from test_cache_bookkeeping import Loads, Packed, Pool  # noqa: E402  (the cache tests' fakes, reused)

MiB = 2**20
COPIES = 50
STEPS = 20


def measure(waiting: int) -> dict:
    now = [0.0]
    refs = [
        AdapterRef(AdapterKey("base", f"a{i}", "1", f"sha256:{i}"), storage_uri=f"mem://{i}")
        for i in range(2000)
    ]
    loads = Loads()
    cache = native_residency(
        Pool(1),
        lambda files, hashed: None,
        cpu_bytes=COPIES * 10 * MiB,
        max_cpu_loras=COPIES,
        policy=ScorePolicy(),
        executor=loads,
        clock=lambda: now[0],
        loader=lambda ref: Loaded(Packed(10 * MiB), "remote", {"download": 0.01}),
    )

    def land() -> None:
        for fn, ref, future in loads.pending:
            future.set_result(fn(ref))
        loads.pending.clear()
        cache.backend.poll()

    running = refs[-1]
    cache.record_request(running)
    cache.acquire(running)
    land()
    assert cache.acquire(running) is not None  # the only slot, held
    held = refs[:COPIES]
    for ref in held:  # host copies whose requests wait for the slot
        cache.record_request(ref)
        cache.acquire(ref)
    land()
    asking = held + refs[COPIES : COPIES + waiting]
    for ref in asking:
        cache.record_request(ref)
    calls, start = 0, time.perf_counter()
    for _ in range(STEPS):
        now[0] += 0.01
        for ref in asking:
            assert cache.acquire(ref) is None
            calls += 1
    seconds = time.perf_counter() - start
    assert len(cache.backend.cpu) == COPIES and not cache.loading, (
        "the waiting requests' loads must wait for room"
    )
    return {
        "waiting": len(asking),
        "calls": calls,
        "us_per_acquire": seconds / calls * 1e6,
        "ms_per_step": seconds / STEPS * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--waiting", default="100,250,500,1000", help="waiting requests besides the 50 with copies"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(int(n)) for n in args.waiting.split(",")]
    table = Table(
        title=(
            f"acquire with many requests waiting ({COPIES} host copies asked for, one slot held, "
            f"{STEPS} steps)"
        )
    )
    for col in ("waiting requests", "µs per acquire", "scheduling ms per step"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["waiting"]), f"{r['us_per_acquire']:.1f}", f"{r['ms_per_step']:.1f}")
    Console().print(table)
    if args.json:
        machine = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        }
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
