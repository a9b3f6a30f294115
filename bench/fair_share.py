"""Fair share at the router: tenant B's steady traffic while tenant A bursts to 10x its share.

    python bench/fair_share.py [--quick] [--json bench/results/fair_share.json]

Two `loraplex serve` workers (4-layer Llama, `--max-num-seqs 4`: the fleet runs 8 requests at a
time) behind one `loraplex router` (`--saturation-waiting 0`). Tenants A and B have the same
priority and weight and one adapter each; with both busy each is owed 4 of the 8 running places. B
sends an open-loop Poisson stream of 2 requests a second for two minutes (240 requests), after one
unmeasured request that opens its connection: B is a steady tenant, connected and active before
A starts, 2 s before B's trace. Six runs of the same B trace, each with a fresh router, B's
figure without the burst twice: B alone; A at its share (4 closed-loop clients: the fleet as
busy as A may keep it). Then A bursts to 10x its share (40 closed-loop clients): with the
router's fair-share queue and its limit on the requests open at a worker (`--worker-queue-limit
0`, the default: nothing beyond what the worker runs, the rest waits at the router) and no place
held back (`--holdback-window-s 0`); the same with the default window (5 s: places kept free for
B while it is active, `router/holdback.py`); the queue without the limit (`-1`: a worker's
first-come queue holds what passes the saturation filter) and no place held back; without the
queue either (`--queue-per-tenant 0`, a saturated pick goes to the worker). TTFT is measured at
the client to the first streamed chunk, and at the workers (their audit logs' `ttft_ms`: from the
request's arrival at the worker to its first token).

As in a deployment, where each tenant's clients run on machines of their own and the router does
not share the workers' cores, each tenant's clients are a process of their own (each with its
imports frozen out of its collector's view), and on this bench's shared cores the router and B's
client run 10 nice levels ahead of the workers and A's load generator (`FRONT`, `BACK`): when
both want a core, the router and B's client get it first. As root (which may lower a nice value)
the router and B's client run at -10 and the rest at 0, so that other jobs on the machine take no
more from the workers than before; otherwise the router and B's client run at 0 and the rest at
10. The same in every run, B alone included.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from adapter_load import write_adapter
from cache_policy import build_model

from loraplex.loadgen.procs import start_router, start_worker
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

FRONT, BACK = (-10, 0) if os.geteuid() == 0 else (0, 10)
"""The nice values of the router and B's client, and of the workers and A's load generator."""
OFF = ("--holdback-window-s", "0")
WARM_UP = "b-warm-up"
"""The request id of B's unmeasured first request."""
RUNS = {
    "B alone": (0, ()),
    "A at its share": (4, ()),
    "A bursts, fair share": (40, OFF),
    "A bursts, fair share, held-back place": (40, ()),
    "A bursts, fair share, no worker limit": (40, ("--worker-queue-limit", "-1", *OFF)),
    "A bursts, no queue": (40, ("--queue-per-tenant", "0", "--worker-queue-limit", "-1")),
}


def build(tmp: Path) -> tuple[Path, str, dict[str, str]]:
    model_dir = build_model(tmp / "model")
    cfg = ModelConfig.from_dir(model_dir)
    registry = Registry(f"sqlite:///{tmp / 'registry.db'}", base_model_dir=model_dir)
    registry.init()
    keys = {}
    for tenant in ("a", "b"):
        registry.add_tenant(tenant, 0)
        keys[tenant] = registry.create_key(tenant)
        path = write_adapter(cfg, 8, torch.float32, tmp / "adapters" / tenant)
        registry.add_revision(path, f"{tenant}-bot", tenant=tenant, status="stable")
    registry.close()
    return model_dir, registry.url, keys


async def one(
    client: httpx.AsyncClient, url: str, tenant: str, key: str, tokens: int, request_id: str = ""
) -> dict:
    body = {
        "model": f"{tenant}-bot",
        "prompt": "Please summarise the account history in a few words.",
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    record: dict = {}
    sent = time.perf_counter()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        if request_id:
            headers["x-request-id"] = request_id
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            record["status"] = r.status_code
            async for _ in r.aiter_raw():
                record.setdefault("ttft", time.perf_counter() - sent)
    except httpx.HTTPError as exc:
        record["status"] = type(exc).__name__
    return record


async def b_trace(url: str, key: str, b_times: list[float]) -> dict:
    """B's open-loop trace: its requests at `b_times` seconds from the start. First one request
    that is not measured (`WARM_UP`), then a line on stdout, and the trace once a line comes on
    stdin: B is a steady tenant, connected and active before A's burst starts."""
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        await one(client, url, "b", key, 16, WARM_UP)
        print("warm", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start = time.perf_counter()

        async def b_request(at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await one(client, url, "b", key, 16)

        b_records = await asyncio.gather(*(b_request(at) for at in b_times))
        return {"b": b_records, "seconds": time.perf_counter() - start}


def a_burst(url: str, key: str, a_clients: int) -> None:
    """A's load generator (a process of its own): `a_clients` closed-loop clients until its stdin
    closes; prints a line once they run, then A's answered and refused counts as JSON."""

    frozen()

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        stop = loop.run_in_executor(None, sys.stdin.read)  # returns when stdin closes
        counts = {"answered": 0, "refused": 0}
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:

            async def a_client():
                while not stop.done():
                    record = await one(client, url, "a", key, 32)
                    counts["answered" if record.get("status") == 200 else "refused"] += 1

            clients = [asyncio.create_task(a_client()) for _ in range(a_clients)]
            print("running", flush=True)
            await asyncio.gather(*clients)
        return counts

    print(json.dumps(asyncio.run(main())), flush=True)


def load(url: str, keys: dict[str, str], b_times: list[float], a_clients: int) -> dict:
    """B's trace from a client process of its own (at nice `FRONT`), with `a_clients`
    closed-loop clients of A in another (at nice `BACK`, as the workers), started after B's
    unmeasured first request and 2 s before B's trace, for as long as it lasts."""
    command = [sys.executable, __file__, "--tenant-b", url, keys["b"]]
    b = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    renice(b.pid, FRONT)
    burst = None
    a_counts = json.dumps({"answered": 0, "refused": 0})
    try:
        b.stdin.write(json.dumps(b_times) + "\n")
        b.stdin.flush()
        b.stdout.readline()  # B's first request answered
        if a_clients:
            command = [sys.executable, __file__, "--tenant-a", url, keys["a"], str(a_clients)]
            burst = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            renice(burst.pid, BACK)
            burst.stdout.readline()
            time.sleep(2.0)  # the burst under way before B's trace
        b.stdin.write("go\n")
        b.stdin.flush()
        result = b.stdout.readline()
    finally:
        if burst is not None:
            burst.stdin.close()
            a_counts = burst.stdout.readline()
            burst.wait()
        b.stdin.close()
        if b.wait():
            raise RuntimeError(f"B's client process exited {b.returncode}")
    return {**json.loads(result), "a": json.loads(a_counts)}


def frozen() -> None:
    """A client process's imports out of its collector's view: a full collection over torch's
    objects stalls the client's loop for a fifth of a second, which is no part of a request's
    time."""
    gc.collect()
    gc.freeze()


def renice(pid: int, niceness: int) -> None:
    """Every thread of process `pid` and of its children at `niceness` (the threads they start
    later inherit it)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                renice(int(child), niceness)
    except (FileNotFoundError, ProcessLookupError):  # a thread or process that ended meanwhile
        pass


def audit_lines(data_dir: Path) -> list[dict]:
    """A worker's audit log (`serve`'s default, in its data directory): a line per request."""
    path = data_dir / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None


def run(tmp: Path, name: str, workers, registry_url: str, keys, b_times, a_clients, flags) -> dict:
    """One run of B's trace through a fresh router, with `a_clients` of A beside it."""
    router = start_router(
        [w.url for w in workers],
        tmp / name.replace(" ", "").replace(",", ""),
        "affinity",
        "--registry",
        registry_url,
        "--saturation-waiting",
        "0",
        *flags,
    )
    renice(router.p.pid, FRONT)
    data_dirs = [tmp / f"w{i}" for i in range(len(workers))]  # as `main` starts them
    seen = [len(audit_lines(d)) for d in data_dirs]
    try:
        time.sleep(1.5)
        result = load(router.url, keys, b_times, a_clients)
    finally:
        router.stop()
    b_ok = [r["ttft"] for r in result["b"] if r.get("status") == 200 and "ttft" in r]
    time.sleep(1.0)  # the workers' last audit lines written
    at_workers = [
        line["ttft_ms"] / 1000
        for d, n in zip(data_dirs, seen, strict=True)
        for line in audit_lines(d)[n:]
        if line.get("tenant") == "b"
        and line.get("request_id") != WARM_UP
        and line.get("ttft_ms") is not None
    ]
    return {
        "run": name,
        "b_ok": f"{len(b_ok)}/{len(result['b'])}",
        "b_ttft_p50_ms": pct(b_ok, 0.5),
        "b_ttft_p99_ms": pct(b_ok, 0.99),
        "b_worker_ttft_p50_ms": pct(at_workers, 0.5),
        "b_worker_ttft_p99_ms": pct(at_workers, 0.99),
        "a_answers_per_s": round(result["a"]["answered"] / result["seconds"], 1),
        "a_refused": result["a"]["refused"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tenant-a"]:
        a_burst(argv[1], argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["--tenant-b"]:
        frozen()
        b_times = json.loads(sys.stdin.readline())
        print(json.dumps(asyncio.run(b_trace(argv[1], argv[2], b_times))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench/results/fair_share.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    rng = random.Random(1)
    t, b_times = 0.0, []
    for _ in range(40 if args.quick else 240):
        t += rng.expovariate(2.0)
        b_times.append(t)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, registry_url, keys = build(tmp)
        extra = ("--registry", registry_url, "--max-num-seqs", "4", "--max-loras", "2")
        workers = [start_worker(model_dir, tmp / f"w{i}", {}, *extra) for i in range(2)]
        try:
            for w in workers:
                renice(w.p.pid, BACK)
            for name, (a_clients, flags) in RUNS.items():
                rows.append(run(tmp, name, workers, registry_url, keys, b_times, a_clients, flags))
                console.log(rows[-1])
        finally:
            for w in workers:
                w.stop()
    table = Table(title="Tenant B (2 req/s) while tenant A bursts to 10x its share, 2 workers")
    for c in rows[0]:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    # B's p99 in each run over its p99 without the burst: B alone, and A at its share
    goals = {}
    for key, field in (("b_p99", "b_ttft_p99_ms"), ("b_worker_p99", "b_worker_ttft_p99_ms")):
        for i, base in enumerate(rows[:2]):
            for row in rows[i + 1 :]:
                goals[f"{key}: {row['run']} / {base['run']}"] = round(row[field] / base[field], 2)
    console.print(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "goals": goals}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
