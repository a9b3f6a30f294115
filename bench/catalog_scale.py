"""A catalog of many adapters at flat cost: registry, worker and change feed, side by side.

    python bench/catalog_scale.py [--quick] [--json OUT]

Sizes (full / --quick): SMALL 50 / 20 and LARGE 10,000 / 500 adapters registered on a worker;
IMPORT 10,000 / 500 adapters imported; HUGE 100,000 / 5,000 in a registry; WORKERS 8 / 2.

- import: `Registry.add_revisions` (what `registry import` runs) of IMPORT distinct rank-4 adapters
  of the tests' tiny Llama, on SQLite and on PostgreSQL (a throwaway cluster), adapters/s.
- small vs large: two `loraplex serve` workers (4 slots, `--engine-core thread`), adapters
  registered one by one through `POST /v1/load_lora_adapter` (SMALL on one, LARGE on the other,
  timed each); then the same workload on both, in alternating rounds: 1-token completions from 4
  clients, Zipf over the same 50 names. Server CPU per request (/proc), `/v1/models` p99 (30 calls),
  the RSS the registrations added per adapter, registration of the first vs the last 10%.
- huge: HUGE adapters in a SQLite registry (one registered, the rest copies of its rows, made in
  SQL), `loraplex serve` (its default engine core, a process of its own) on it and on an empty one:
  seconds from the command to `/ready`; then, while nothing else runs and while catalog operations
  run (a full and a paged `/v1/models`, a registration through the API, 100 adapters imported by
  this process, the full listing again): the server's event-loop stalls (its
  `loraplex_event_loop_lag_seconds`), and the gaps between the chunks of base-model streams read by
  a process of their own (on 2 cores these include the engine process's and the reader's turns on
  a core: over 10 ms now and then with an empty catalog and nothing else running).
- fleet: WORKERS workers on one PostgreSQL registry; 20 registrations made by this process, each
  timed from its commit to when every worker lists it (each polled every 2 ms); and the
  statements the workers sent the database (their connections log them) while they answered 40
  requests each with no change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file
from sqlalchemy import insert, select

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.postgres import as_postgres, postgres_bin
from loraplex.loadgen.procs import ADMIN_TOKEN, Proc
from loraplex.registry import Registry
from loraplex.registry.bulk import ImportItem
from loraplex.registry.db import Adapter, Revision, Traffic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinymodels import make_adapter, make_model  # noqa: E402  (the tests' fixture builders, reused)

DEFAULT_JSON = Path(__file__).parent / "results" / "catalog_scale.json"
KEY = "bench-key-0123456789abcdef"
FULL = {"small": 50, "large": 10_000, "import": 10_000, "huge": 100_000, "workers": 8}
QUICK = {"small": 20, "large": 500, "import": 500, "huge": 5_000, "workers": 2}
HOT = 50  # the names the workload asks for


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- fixtures ------------------------------------------------------------------------------------


def make_variants(template: Path, root: Path, n: int) -> list[Path]:
    """`n` adapter directories of the template's shapes, each with bytes of its own."""
    tensors = load_file(template / "adapter_model.safetensors")
    config = (template / "adapter_config.json").read_bytes()
    out = []
    for i in range(n):
        d = root / f"ad-{i:06d}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_bytes(config)
        scale = 1 + 1e-4 * (i + 1)
        save_file(
            {k: v * scale if "lora_B" in k else v for k, v in tensors.items()},
            d / "adapter_model.safetensors",
        )
        out.append(d)
    return out


@contextlib.contextmanager
def pg_cluster(work: Path):
    """A throwaway PostgreSQL cluster on a socket in `work`: yields (url of a fresh schema maker,
    socket dir, log path)."""
    bin_dir = postgres_bin()
    assert bin_dir is not None, "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin)"
    as_user = as_postgres()
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    if as_user:
        shutil.chown(work, "postgres")

    def run(*args):
        subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)

    data = work / "data"
    run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    options = f"-k {work} -c listen_addresses='' -c fsync=off -c max_connections=200"
    run(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(work / "log"),
        "-w",
        "start",
    )
    try:
        yield work
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")


def pg_schema(socket_dir: Path, name: str, log_statements: bool = False) -> str:
    import psycopg

    with psycopg.connect(
        host=str(socket_dir), user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    extra = "-clog_statement%3Dall%20" if log_statements else ""
    return (
        f"postgresql://postgres@/postgres?host={socket_dir}&options={extra}-csearch_path%3D{name}"
    )


def open_registry(url: str, store: Path, model: Path) -> Registry:
    registry = Registry(url, ArtifactStore(store), base_model_dir=model, max_lora_rank=16)
    registry.init()
    return registry


def serve(
    model: Path, url: str, work: Path, name: str, *extra: str, engine_core: str = "thread"
) -> Proc:
    """A worker; `--engine-core thread` keeps all of its CPU in one process (what is measured)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "keys").write_text(f"bench {KEY}\n")
    (work / "admin-token").write_text(ADMIN_TOKEN + "\n")
    return Proc(
        [
            "serve",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--port",
            "0",
            "--data-dir",
            str(work / name),
            "--registry",
            url,
            "--engine-core",
            engine_core,
            "--dtype",
            "float32",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "16",
            "--api-keys",
            str(work / "keys"),
            "--admin-token-file",
            str(work / "admin-token"),
            *extra,
        ],
        work / f"{name}.log",
    )


AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# ---- import --------------------------------------------------------------------------------------


def bench_import(variants: list[Path], model: Path, work: Path, pg_dir: Path) -> dict:
    out = {}
    for kind in ("sqlite", "postgresql"):
        url = f"sqlite:///{work}/import.db" if kind == "sqlite" else pg_schema(pg_dir, "imp")
        registry = open_registry(url, work / f"import-store-{kind}", model)
        items = [ImportItem(path=p, name=p.name, stable=True) for p in variants]
        start = time.perf_counter()
        result = registry.add_revisions(items)
        seconds = time.perf_counter() - start
        registry.close()
        out[kind] = {
            "adapters": len(result.records),
            "seconds": seconds,
            "per_s": len(result.records) / seconds,
        }
    return out


# ---- small vs large ------------------------------------------------------------------------------


def register_all(url: str, variants: list[Path]) -> list[float]:
    seconds = []
    with httpx.Client(timeout=120) as client:
        for path in variants:
            start = time.perf_counter()
            r = client.post(
                f"{url}/v1/load_lora_adapter",
                headers=ADMIN,
                json={"lora_name": path.name, "lora_path": str(path)},
            )
            r.raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


async def workload(url: str, names: list[str], n: int, seed: int) -> None:
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(names))]
    todo = iter(rng.choices(names, weights, k=n))
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:

        async def worker():
            for model in todo:
                r = await client.post(
                    f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}
                )
                r.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(4)))


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.02)
    raise RuntimeError(f"{url} was not ready in {timeout} s")


def models_times(url: str, calls: int = 30) -> list[float]:
    """`/v1/models` one after another; the first after the last change makes the listing."""
    times = []
    with httpx.Client(timeout=120, headers=AUTH) as client:
        for _ in range(calls):
            start = time.perf_counter()
            client.get(f"{url}/v1/models").raise_for_status()
            times.append(time.perf_counter() - start)
    return times


def bench_small_vs_large(sizes, variants, model, work) -> dict:
    procs = {}
    figures: dict[str, dict] = {}
    try:
        for label in ("small", "large"):
            url = f"sqlite:///{work}/{label}/registry.db"
            procs[label] = serve(
                model, url, work, label, "--allowed-roots", str(variants[0].parent)
            )
        for label, proc in procs.items():
            pid = proc.p.pid
            asyncio.run(workload(proc.url, ["tiny"], 20, 0))  # warm
            half = sizes[label] // 2
            reg = register_all(proc.url, variants[:half])
            rss0 = rss_bytes(pid)  # from the second half: the first carries one-off costs
            reg += register_all(proc.url, variants[half : sizes[label]])
            tenth = max(1, len(reg) // 10)
            figures[label] = {
                "registered": len(reg),
                "register_first_ms": statistics.median(reg[:tenth]) * 1000,
                "register_last_ms": statistics.median(reg[-tenth:]) * 1000,
                "rss_per_adapter_bytes": (rss_bytes(pid) - rss0) / (len(reg) - half),
            }
        hot = [p.name for p in variants[:HOT]]
        for proc in procs.values():  # warm: the hot adapters' first loads
            asyncio.run(workload(proc.url, hot[: sizes["small"]], 100, 1))
        cpu = {label: [] for label in procs}
        for round_ in range(3):
            for label, proc in procs.items():
                n = 300
                before = cpu_seconds(proc.p.pid)
                asyncio.run(workload(proc.url, hot[: sizes["small"]], n, 10 + round_))
                cpu[label].append((cpu_seconds(proc.p.pid) - before) * 1000 / n)
        for label, proc in procs.items():
            figures[label]["cpu_ms_per_request"] = statistics.median(cpu[label])
            times = models_times(proc.url)
            figures[label]["models_first_ms"] = times[0] * 1000
            figures[label]["models_p50_ms"] = statistics.median(times) * 1000
            figures[label]["models_p99_ms"] = pct(times, 0.99) * 1000
    finally:
        for proc in procs.values():
            proc.stop()
    return figures


# ---- huge ----------------------------------------------------------------------------------------


def clone_catalog(registry: Registry, template: str, n: int) -> None:
    """`n` adapters that are copies of `template`'s rows (names c000000...), in one transaction."""
    with registry.db.write() as session:
        adapter = session.get(Adapter, template)
        revision = session.scalar(select(Revision).where(Revision.adapter_name == template))
        a = {c.name: getattr(adapter, c.name) for c in Adapter.__table__.columns}
        r = {
            c.name: getattr(revision, c.name) for c in Revision.__table__.columns if c.name != "id"
        }
        names = [f"c{i:06d}" for i in range(n)]
        session.execute(insert(Adapter), [{**a, "name": name} for name in names])
        session.execute(insert(Revision), [{**r, "adapter_name": name} for name in names])
        ids = session.execute(
            select(Revision.adapter_name, Revision.id).where(Revision.adapter_name.like("c%"))
        ).all()
        session.execute(
            insert(Traffic),
            [{"adapter_name": name, "revision_id": i, "weight": 100} for name, i in ids],
        )


class StreamGaps:
    """Base-model streams one after another in a process of its own (this one's work must not
    delay its reads), recording (time, gap) between the chunks of each; `take()` the gaps since
    the last take."""

    def __init__(self, url: str, work: Path):
        self.out, self.stop_file = work / "gaps.json", work / "gaps.stop"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--gaps", url, str(self.out), str(self.stop_file)]
        )
        self.since = time.monotonic()
        self.windows: list[tuple[float, float]] = []

    def __enter__(self):
        started = self.out.with_suffix(".started")  # its first stream is done: the server warm
        deadline = time.monotonic() + 120
        while not started.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stream recorder finished no stream (see its output)")
            time.sleep(0.05)
        time.sleep(0.5)
        self.since = time.monotonic()
        return self

    def take(self) -> None:
        now = time.monotonic()
        self.windows.append((self.since, now))
        self.since = now

    def __exit__(self, *_):
        self.stop_file.touch()
        self.proc.wait(60)

    def gaps(self) -> list[list[float]]:
        """The gaps of each window taken."""
        pairs = json.loads(self.out.read_text())
        return [[g for t, g in pairs if a <= t < b] for a, b in self.windows]


def record_gaps(url: str, out: Path, stop_file: Path) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 64, "stream": True}
    pairs = []
    with httpx.Client(timeout=60, headers=AUTH) as client:
        while not stop_file.exists():
            last = None
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    now = time.monotonic()
                    if line.startswith("data: ") and last is not None:
                        pairs.append((now, now - last))
                    last = now
            out.with_suffix(".started").touch()
    out.write_text(json.dumps(pairs))


def gap_figures(gaps: list[float]) -> dict:
    return {
        "chunks": len(gaps),
        "p99_ms": pct(gaps, 0.99) * 1000,
        "max_ms": max(gaps) * 1000,
        "over_10ms": sum(g > 0.010 for g in gaps),
    }


def loop_lag(url: str) -> dict[str, float]:
    """The server's event-loop lag histogram now: {bound: samples at most that late}."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "loraplex_event_loop_lag_seconds"
    ]
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


def lag_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """The samples between two readings: how many, how many later than 5 and 10 ms, and the
    bound under which all of them were."""
    n = {le: after[le] - before[le] for le in after}
    total = n["+Inf"]
    return {
        "samples": total,
        "over_5ms": total - n["0.005"],
        "over_10ms": total - n["0.01"],
        "max_under_ms": min(float(le) for le in n if n[le] == total) * 1000,
    }


def bench_huge(sizes, variants, model, work) -> dict:
    out: dict = {}
    url = f"sqlite:///{work}/huge/registry.db"
    registry = open_registry(url, work / "huge" / "artifacts", model)
    registry.add_revision(variants[0], "template", shared=True, status="stable")
    start = time.perf_counter()
    clone_catalog(registry, "template", sizes["huge"])
    out["clone_s"] = time.perf_counter() - start
    empty_url = f"sqlite:///{work}/empty/registry.db"
    open_registry(empty_url, work / "empty" / "artifacts", model).close()
    roots = ("--allowed-roots", str(variants[0].parent))
    for label, u in (("empty", empty_url), ("huge", url)):
        start = time.perf_counter()
        # the default engine core (a process of its own): the API server's loop alone in its GIL
        proc = serve(model, u, work, f"start-{label}", *roots, engine_core="process")
        wait_ready(proc.url)  # the catalog is read at the app's start, after the address line
        out[f"startup_{label}_s"] = time.perf_counter() - start
        if label == "empty":
            proc.stop()
    try:
        with StreamGaps(proc.url, work) as streams:
            lags = [loop_lag(proc.url)]
            time.sleep(3)
            streams.take()  # idle
            lags.append(loop_lag(proc.url))
            with httpx.Client(timeout=300, headers=AUTH) as client:
                start = time.perf_counter()
                full = client.get(f"{proc.url}/v1/models")
                out["models_full_s"] = time.perf_counter() - start
                out["models_full_bytes"] = len(full.content)
                client.get(f"{proc.url}/v1/models", params={"limit": 100, "after": "c050000"})
                client.post(
                    f"{proc.url}/v1/load_lora_adapter",
                    headers=ADMIN,
                    json={"lora_name": "fresh", "lora_path": str(variants[1])},
                ).raise_for_status()
                registry.add_revisions(
                    [
                        ImportItem(path=p, name=f"more-{p.name}", stable=True)
                        for p in variants[2:102]
                    ]
                )
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    seen = client.get(
                        f"{proc.url}/v1/models", params={"after": "more-ad-000100", "limit": 1}
                    ).json()["data"]
                    if seen and seen[0]["id"] == "more-ad-000101":
                        break
                    time.sleep(0.05)
                client.get(f"{proc.url}/v1/models")  # listed again after the change
            time.sleep(0.5)
            streams.take()  # during the operations
            lags.append(loop_lag(proc.url))
        idle, during = streams.gaps()
        out["idle"], out["during_ops"] = gap_figures(idle), gap_figures(during)
        out["loop_idle"], out["loop_during_ops"] = (
            lag_figures(lags[0], lags[1]),
            lag_figures(lags[1], lags[2]),
        )
    finally:
        proc.stop()
        registry.close()
    return out


# ---- fleet ---------------------------------------------------------------------------------------


async def until_listed(urls: list[str], before: str, name: str, committed: float) -> list[float]:
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as client:

        async def one(url: str) -> float:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = await client.get(f"{url}/v1/models", params={"after": before, "limit": 1})
                data = r.json()["data"]
                if data and data[0]["id"] == name:
                    return time.monotonic() - committed
                await asyncio.sleep(0.002)
            raise RuntimeError(f"{name} did not reach {url} in 30 s")

        return await asyncio.gather(*(one(u) for u in urls))


def logged(log: Path, start: str, end: str) -> int:
    lines = log.read_text(errors="replace").splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i, line in enumerate(lines) if end in line)
    return sum("statement:" in line for line in lines[first + 1 : last])


def bench_fleet(sizes, variants, model, work, pg_dir) -> dict:
    import psycopg

    url = pg_schema(pg_dir, "fleet", log_statements=False)
    registry = open_registry(url, work / "fleet-store", model)
    registry.add_revision(variants[0], "a-base", shared=True, status="stable")
    logged_url = url.replace("&options=", "&options=-clog_statement%3Dall%20")
    roots = ("--allowed-roots", str(work / "fleet-store"))
    procs = [serve(model, logged_url, work, f"fleet{i}", *roots) for i in range(sizes["workers"])]
    try:
        urls = [p.url for p in procs]
        delays: list[float] = []
        previous = "a-base"  # names sort after it: each is polled as the one after the last
        for i in range(20):
            name = f"p-{i:03d}"
            registry.add_revision(variants[1 + i], name, shared=True, status="stable")
            committed = time.monotonic()
            delays += asyncio.run(until_listed(urls, previous, name, committed))
            previous = name
        conn = psycopg.connect(
            host=str(pg_dir), user="postgres", dbname="postgres", autocommit=True
        )
        for u in urls:  # each digest's first request reads its files: before the window
            asyncio.run(workload(u, ["a-base", "p-000", "tiny"], 6, 2))
        conn.execute("SET log_statement = 'all'")
        time.sleep(0.5)
        conn.execute("SELECT 'lpx-window-start'")
        for u in urls:
            asyncio.run(workload(u, ["a-base", "p-000", "tiny"], 40, 3))
        conn.execute("SELECT 'lpx-window-end'")
        conn.close()
        statements = logged(pg_dir / "log", "lpx-window-start", "lpx-window-end")
        num_requests = 40 * len(urls)
    finally:
        for proc in procs:
            proc.stop()
        registry.close()
    return {
        "workers": len(procs),
        "samples": len(delays),
        "propagation_p50_ms": pct(delays, 0.5) * 1000,
        "propagation_p99_ms": pct(delays, 0.99) * 1000,
        "propagation_max_ms": max(delays) * 1000,
        "statements_per_request": statements / num_requests,
    }


# ---- report --------------------------------------------------------------------------------------


def goals(r: dict) -> list[tuple[str, str, str, bool | None]]:
    """(goal, figure, target, met); met is None for a figure given as context."""
    s, big = r["serving"]["small"], r["serving"]["large"]
    cpu = big["cpu_ms_per_request"] / s["cpu_ms_per_request"]
    h, f, i = r["huge"], r["fleet"], r["import"]
    return [
        (
            f"server CPU/request, {big['registered']:,} vs {s['registered']}",
            f"{big['cpu_ms_per_request']:.2f} / {s['cpu_ms_per_request']:.2f} ms = {cpu:.2f}x",
            "<= 1.1x",
            cpu <= 1.1,
        ),
        (
            f"/v1/models p99, {big['registered']:,} registered",
            f"{big['models_p99_ms']:.1f} ms (p50 {big['models_p50_ms']:.1f}, first "
            f"{big['models_first_ms']:.1f})",
            "< 50 ms",
            big["models_p99_ms"] < 50,
        ),
        (
            "registration, first 10% -> last 10%",
            f"{big['register_first_ms']:.1f} -> {big['register_last_ms']:.1f} ms",
            "last <= first",
            big["register_last_ms"] <= big["register_first_ms"] * 1.05,
        ),
        (
            "RSS growth per registered adapter",
            f"{big['rss_per_adapter_bytes'] / 1024:.2f} KB",
            "< 5 KB",
            big["rss_per_adapter_bytes"] < 5 * 1024,
        ),
        (
            f"bulk import of {i['sqlite']['adapters']:,}, SQLite",
            f"{i['sqlite']['per_s']:.0f}/s",
            ">= 200/s",
            i["sqlite"]["per_s"] >= 200,
        ),
        (
            f"bulk import of {i['postgresql']['adapters']:,}, PostgreSQL",
            f"{i['postgresql']['per_s']:.0f}/s",
            ">= 200/s",
            i["postgresql"]["per_s"] >= 200,
        ),
        (
            f"startup with {r['sizes']['huge']:,} registered (empty)",
            f"{h['startup_huge_s']:.1f} s ({h['startup_empty_s']:.1f} s)",
            "< 10 s",
            h["startup_huge_s"] < 10,
        ),
        (
            "server loop stalls > 10 ms during catalog ops (idle)",
            f"{_lags(h['loop_during_ops'])} ({_lags(h['loop_idle'])})",
            "none",
            h["loop_during_ops"]["over_10ms"] == 0,
        ),
        (
            "stream chunk gaps > 10 ms during catalog ops (idle)",
            f"{_gaps(h['during_ops'])} ({_gaps(h['idle'])})",
            "context",
            None,
        ),
        (
            "registry statements per request, steady",
            f"{f['statements_per_request']:.3f}",
            "0",
            f["statements_per_request"] == 0,
        ),
        (
            f"change propagation to {f['workers']} workers, p99 (max)",
            f"{f['propagation_p99_ms']:.0f} ms ({f['propagation_max_ms']:.0f} ms)",
            "< 250 ms",
            f["propagation_p99_ms"] < 250,
        ),
    ]


def _lags(g: dict) -> str:
    return f"{g['over_10ms']:.0f} of {g['samples']:.0f}, all under {g['max_under_ms']:g} ms"


def _gaps(g: dict) -> str:
    return f"{g['over_10ms']} of {g['chunks']}, max {g['max_ms']:.0f} ms"


def main() -> None:
    if sys.argv[1:2] == ["--gaps"]:  # the stream recorder's own process
        record_gaps(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.json is None:
        args.json = DEFAULT_JSON.with_suffix(".quick.json") if args.quick else DEFAULT_JSON
    sizes = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="loraplex-catalog-"))
    work.chmod(0o755)  # PostgreSQL's own user reaches its cluster inside
    try:
        model = make_model(work / "model", "llama")
        template = make_adapter(
            model, work / "template", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        )
        need = max(sizes["import"], sizes["large"], 130)
        variants = make_variants(template, work / "adapters", need)
        result: dict = {
            "sizes": sizes,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
        }
        with pg_cluster(work / "pg") as pg_dir:
            result["import"] = bench_import(variants[: sizes["import"]], model, work, pg_dir)
            result["serving"] = bench_small_vs_large(sizes, variants, model, work)
            result["huge"] = bench_huge(sizes, variants, model, work)
            result["fleet"] = bench_fleet(sizes, variants, model, work, pg_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"catalog at scale ({'quick' if args.quick else 'full'})")
    for column in ("goal", "figure", "target", "met"):
        table.add_column(column)
    rows = goals(result)
    for what, figure, target, met in rows:
        table.add_row(what, figure, target, "-" if met is None else "yes" if met else "NO")
    Console().print(table)
    result["goals"] = [{"goal": w, "figure": f, "target": t, "met": m} for w, f, t, m in rows]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
