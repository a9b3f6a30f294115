"""The router at catalog scale: polling bytes with nothing changing, and the picker's cost per
request, at 50 and 10,000 adapters per worker, side by side in one run.

    python bench/router_scale.py [--sizes 50,10000] [--polls 20] [--picks 20000]
        [--json bench/results/router_scale.json]

Each worker is a stand-in at the HTTP boundary: a FastAPI app serving the real admin API
(`loraplex.server.admin`: its token check, `/admin/state` and its routing view, the real
`StateFeed`) over a real socket, whose server object answers a synthetic whole state of N adapter
rows shaped as a worker's (4 in slots, up to 200 in host memory, the rest on disk). The real router
`Fleet` polls it. Rows measured per size:
- the whole answer's bytes (what one poll cost when the router read the whole state);
- the first routing poll (every adapter resident or loading), then the body bytes per poll over
  `--polls` polls with nothing changing, then one poll after one adapter moved into a slot;
- the worker's time to answer one routing poll (it still builds and diffs its whole state);
- the picker's cost per request: `Picker.pick(fleet.views(), adapter)` over 8 workers holding N
  adapters each, adapters drawn Zipf(0.9) from a catalog twice what they hold (so that some picks
  are cold at every size), per kind of pick (resident somewhere, or cold); 5 rounds alternating
  between the sizes, the median round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from rich.console import Console
from rich.table import Table

from loraplex.router.fleet import Fleet
from loraplex.router.picker import Picker
from loraplex.server import admin
from loraplex.server.state_feed import StateFeed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from harness import serving  # noqa: E402 (uvicorn in a thread on a free port)

TOKEN = "bench-admin-token-0123456789"
WORKERS = 8


def rows(num: int, offset: int = 0) -> list[dict]:
    """A worker's adapter rows as `/admin/state` gives them: 4 in slots, up to 200 in cpu, the rest
    on disk."""
    out = []
    for i in range(num):
        name = f"ad{(i + offset) % (num * WORKERS):06d}"
        tier = "gpu" if i < 4 else "cpu" if i < 200 else "disk"
        out.append(
            {
                "name": name,
                "revision": "1",
                "digest": f"sha256:{i + offset:064x}",
                "base_model_digest": f"sha256:{7:064x}",
                "tenant": f"t{i % 8}",
                "charged_to": [f"t{i % 8}"],
                "tier": tier,
                "loading": False,
                "bytes": 18874368,
                "pinned": None,
                "in_flight": 0,
                "hits": 3,
                "loads": 1,
                "evictions": 0,
                "last_access_s_ago": 12.5,
                "demand_5m": 0.1,
                "warm": None,
                "model": name,
            }
        )
    return out


class StandIn:
    """What the admin API's `/admin/state` reads of a server: `state()`."""

    def __init__(self, adapters: list[dict]):
        self.adapters = adapters

    def state(self) -> dict:
        return {
            "base_model": "llama",
            "base_model_digest": f"sha256:{7:064x}",
            "max_loras": 4,
            "draining": False,
            "adapters": self.adapters,
            "load": {
                "waiting": 0,
                "running": 0,
                "active_tokens": 0,
                "recent_evictions": 0,
                "free_slots": 0,
                "num_slots": 4,
                "kv_cache_usage": 0.0,
                "admitted_waiting": 0,
                "in_flight": 0,
            },
            "tenants": {},
            "cache": {"cpu_bytes_used": 0, "thrash_ratio": 0.0},
        }


def worker_app(server: StandIn) -> FastAPI:
    app = FastAPI()
    app.state.server = server
    app.include_router(admin.router(TOKEN))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


async def poll_figures(url: str, server: StandIn, polls: int) -> dict:
    import httpx

    fleet = Fleet([url], TOKEN)
    worker = fleet.workers[url]
    try:
        whole = await fleet.client.get(
            f"{url}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        await fleet.poll_once()
        first = worker.state_bytes
        idle, started = [], time.perf_counter()
        for _ in range(polls):
            await fleet.poll_once()
            idle.append(worker.state_bytes)
        poll_ms = (time.perf_counter() - started) / polls * 1000
        moved = server.adapters[-1]  # into a slot, from host memory or disk
        moved["tier"] = "gpu"
        await fleet.poll_once()
        changed = worker.state_bytes
        seen = moved["name"] in worker.index.gpu
        # the worker's time for one routing poll, without the 304 (a delta of nothing)
        async with httpx.AsyncClient() as client:
            params = {"view": "routing", "since": worker.generation}
            headers = {"Authorization": f"Bearer {TOKEN}"}
            started = time.perf_counter()
            for _ in range(polls):
                r = await client.get(f"{url}/admin/state", params=params, headers=headers)
            delta_ms = (time.perf_counter() - started) / polls * 1000
            delta_bytes = len(r.content)
    finally:
        await fleet.stop()
    return {
        "whole_answer_bytes": len(whole.content),
        "first_poll_bytes": first,
        "idle_poll_bytes_mean": sum(idle) / len(idle),
        "idle_poll_bytes_max": max(idle),
        "idle_delta_bytes_without_etag": delta_bytes,
        "poll_after_one_change_bytes": changed,
        "change_seen": seen,
        "poll_ms": round(poll_ms, 3),
        "delta_answer_ms": round(delta_ms, 3),
    }


def picking_fleet(num: int) -> Fleet:
    """WORKERS workers holding `num` adapters each, their indexes filled from their feeds."""
    fleet = Fleet([f"http://w{i}" for i in range(WORKERS)], None)
    for i, worker in enumerate(fleet.workers.values()):
        feed = StateFeed()
        feed.observe(StandIn(rows(num, offset=i * num)).state())
        worker.apply_routing(feed.view(None))
        worker.polled_at = time.monotonic() + 3600  # fresh for the whole run
    return fleet


def picker_costs(sizes: list[int], picks: int, rounds: int = 5, seed: int = 0) -> dict:
    """µs per pick at each size: rounds of picks alternating between the sizes, the median round
    (a shared machine's load falls on both alike)."""
    fleets = {num: picking_fleet(num) for num in sizes}
    drawn = {}
    for num in sizes:
        catalog = 2 * num * WORKERS  # half on no worker: cold picks at every size
        weights = np.arange(1, catalog + 1, dtype=float) ** -0.9
        draws = np.random.default_rng(seed).choice(catalog, size=picks, p=weights / weights.sum())
        drawn[num] = [f"ad{int(k):06d}" for k in draws]
    # per size and kind of pick (a resident adapter, a cold one), each round's µs per pick
    times: dict[int, dict[str, list[float]]] = {num: {} for num in sizes}
    reasons: dict[int, Counter] = {num: Counter() for num in sizes}
    clock = time.perf_counter
    for _ in range(rounds):
        for num in sizes:
            fleet, picker = fleets[num], Picker("affinity", rng=random.Random(seed))
            spent: Counter = Counter()
            made: Counter = Counter()
            for adapter in drawn[num]:
                started = clock()
                pick = picker.pick(fleet.views(), adapter)
                kind = "cold" if pick.reason == "cold-hash" else "resident"
                spent[kind] += clock() - started
                made[kind] += 1
                reasons[num][pick.reason] += 1
            spent["all"], made["all"] = sum(spent.values()), sum(made.values())
            for kind in spent:
                times[num].setdefault(kind, []).append(spent[kind] / made[kind] * 1e6)
    for fleet in fleets.values():
        asyncio.run(fleet.client.aclose())
    return {
        num: {
            **{
                f"pick_{kind}_us": round(float(np.median(v)), 2)
                for kind, v in sorted(times[num].items())
            },
            "reasons": dict(reasons[num]),
        }
        for num in sizes
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,10000")
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--picks", type=int, default=20000)
    parser.add_argument("--json", default="bench/results/router_scale.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    sizes = [int(n) for n in args.sizes.split(",")]
    picking = picker_costs(sizes, args.picks // 5)
    results = []
    for num in sizes:
        server = StandIn(rows(num))
        with serving(worker_app(server)) as url:
            figures = asyncio.run(poll_figures(url, server, args.polls))
        results.append({"adapters_per_worker": num, **figures, **picking[num]})
        console.log(results[-1])
    table = Table(title=f"Router polling and picking by adapters per worker ({WORKERS} workers)")
    columns = [
        "adapters_per_worker",
        "whole_answer_bytes",
        "first_poll_bytes",
        "idle_poll_bytes_mean",
        "idle_delta_bytes_without_etag",
        "poll_after_one_change_bytes",
        "delta_answer_ms",
        "pick_all_us",
        "pick_resident_us",
        "pick_cold_us",
    ]
    for c in columns:
        table.add_column(c, justify="right")
    for row in results:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    small, large = results[0], results[-1]
    ratios = {
        "idle_poll_bytes_large_over_small": (large["idle_poll_bytes_mean"] + 1)
        / (small["idle_poll_bytes_mean"] + 1),
        "change_poll_bytes_large_over_small": large["poll_after_one_change_bytes"]
        / small["poll_after_one_change_bytes"],
        **{
            f"pick_{kind}_us_large_over_small": large[f"pick_{kind}_us"] / small[f"pick_{kind}_us"]
            for kind in ("all", "resident", "cold")
        },
        "worker_delta_ms_large_over_small": large["delta_answer_ms"] / small["delta_answer_ms"],
    }
    console.print({k: round(v, 3) for k, v in ratios.items()})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "rows": results,
                "ratios": ratios,
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
