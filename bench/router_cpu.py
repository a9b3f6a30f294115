"""The router's CPU per request: what one `loraplex router` process spends to route and relay
streamed answers, side by side for two source trees in alternating rounds.

    python bench/router_cpu.py [--requests 600] [--rounds 3] [--baseline-src DIR]
        [--json bench/results/router_cpu.json]

Two `loraplex serve` workers (the 4-layer hidden-256 model of `bench/fair_share.py`,
`--max-num-seqs 4`) and, per round and tree, a fresh `loraplex router` (`--registry`,
`--saturation-waiting 0`, its defaults otherwise: the fair-share queue, the worker limit and the
held-back place). 40 closed-loop clients of one tenant, in a process of their own, stream
`--requests` answers of 32 tokens each through it (tenant A's load in `bench/fair_share.py`), so
the router's queue holds most of them; beside them a probe asks the router's `/health` every 20
ms (its answer time: how long the router's event loop keeps a new request waiting, as a
collector's pause would). The router's CPU seconds are its process's user + system
time from `/proc/<pid>/stat` over those requests, from the first to the last; divided by the
requests, and by the streamed chunks the clients read. `--baseline-src`: a `src` directory whose
`loraplex` the baseline router runs (`PYTHONPATH`); without it, only this tree is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from fair_share import build, frozen

from loraplex.loadgen.procs import start_router, start_worker

THIS_SRC = str(Path(__file__).resolve().parent.parent / "src")


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(tmp: Path, name: str, src: str, workers, registry_url: str, key: str, n: int) -> dict:
    """`n` requests through a fresh router running the `loraplex` of `src`."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = src
    try:
        router = start_router(
            [w.url for w in workers],
            tmp / f"{name}-{time.monotonic_ns()}",
            "affinity",
            "--registry",
            registry_url,
            "--saturation-waiting",
            "0",
        )
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    try:
        time.sleep(1.5)
        # the clients' process: a line when its first request is answered, one with its counts
        clients = subprocess.Popen(
            [sys.executable, __file__, "--clients", router.url, key, str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        clients.stdout.readline()
        start = cpu_seconds(router.p.pid)
        counts = json.loads(clients.stdout.readline())
        used = cpu_seconds(router.p.pid) - start
        clients.wait()
    finally:
        router.stop()
    health = sorted(counts["health_ms"])
    return {
        "tree": name,
        "requests": counts["requests"],
        "chunks": counts["chunks"],
        "router_cpu_s": round(used, 2),
        "cpu_ms_per_request": round(1000 * used / counts["requests"], 2),
        "cpu_us_per_chunk": round(1e6 * used / counts["chunks"], 1),
        "health_p50_ms": round(statistics.median(health), 1),
        "health_p99_ms": round(health[int(0.99 * len(health))], 1),
        "health_max_ms": round(health[-1], 1),
    }


def clients(url: str, key: str, n: int, concurrency: int = 40) -> None:
    """`concurrency` closed-loop clients stream `n` answers (32 tokens); prints a line when the
    first is answered (the measured span starts) and then the counts of the rest as JSON."""
    import asyncio

    import httpx

    frozen()  # the imports out of the collector's view: its pauses are not the router's

    body = {
        "model": "a-bot",
        "prompt": "Please summarise the account history in a few words.",
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {key}"}

    async def main() -> dict:
        counts: dict = {"requests": 0, "chunks": 0, "failed": 0, "health_ms": []}
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as c:

            async def stream() -> int:
                async with c.stream(
                    "POST", f"{url}/v1/completions", json=body, headers=headers
                ) as r:
                    chunks = 0
                    async for _ in r.aiter_raw():
                        chunks += 1
                    return chunks if r.status_code == 200 else -1

            await stream()
            print("started", flush=True)
            left = [n]

            async def probe() -> None:
                """The router's own answer time while it relays: `/health` every 20 ms."""
                while left[0] > 0:
                    sent = time.perf_counter()
                    await c.get(f"{url}/health")
                    counts["health_ms"].append(1000 * (time.perf_counter() - sent))
                    await asyncio.sleep(0.02)

            async def client() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    chunks = await stream()
                    counts["requests" if chunks >= 0 else "failed"] += 1
                    counts["chunks"] += max(chunks, 0)

            await asyncio.gather(probe(), *(client() for _ in range(concurrency)))
        return counts

    print(json.dumps(asyncio.run(main())), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--clients"]:
        clients(argv[1], argv[2], int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--json", default="bench/results/router_cpu.json")
    args = parser.parse_args(argv)
    trees = [("this tree", THIS_SRC)]
    if args.baseline_src:
        trees.insert(0, ("baseline", str(Path(args.baseline_src).resolve())))
    console = Console(width=160)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, registry_url, keys = build(tmp)
        extra = ("--registry", registry_url, "--max-num-seqs", "4", "--max-loras", "2")
        workers = [start_worker(model_dir, tmp / f"w{i}", {}, *extra) for i in range(2)]
        try:
            for _ in range(args.rounds):
                for name, src in trees:
                    rows.append(
                        one_round(tmp, name, src, workers, registry_url, keys["a"], args.requests)
                    )
                    console.log(rows[-1])
        finally:
            for w in workers:
                w.stop()
    table = Table(title=f"Router CPU per streamed request ({args.requests} requests a round)")
    for c in rows[0]:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    summary = {
        column: {
            name: statistics.median(r[column] for r in rows if r["tree"] == name)
            for name, _ in trees
        }
        for column in ("cpu_ms_per_request", "health_p99_ms", "health_max_ms")
    }
    if args.baseline_src:
        summary["ratios"] = {
            column: round(medians["this tree"] / medians["baseline"], 2)
            for column, medians in summary.items()
        }
    console.print(summary)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
