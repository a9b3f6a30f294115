"""A real `loraplex serve` scraped every second by a real Prometheus with the shipped alert rules,
under workloads that fit the slots or thrash them; the end-to-end test of the rules and the
dashboard (tests/e2e/test_prometheus_alerts.py) and the dashboard's picture in docs/metrics.md
both run on it.

    .venv/bin/python bench/prometheus_proof.py          # renders docs/img/dashboard.png

Needs Debian's `prometheus` (`apt-get install prometheus`; .ci/run installs it) and the demo world
(built on first use, then cached). The rules run with their windows and `for:` divided by
FAST_FACTOR, derived from the shipped file (`fast_rules`): the shipped ones are production's.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/loraplex-rules.yaml"
DASHBOARD = ROOT / "deploy/grafana/loraplex.json"
FAST_FACTOR = 60
"""Production's minutes become seconds: a 10m window 10s, `for: 15m` 15s."""
SCRAPE_S = 1
RATE_INTERVAL = "10s"
"""What `$__rate_interval` stands for in the dashboard's queries here (Grafana's rule: at least
four scrape intervals)."""
EMPTY_MARK = "Empty until"
"""A panel whose description starts so has no series until its condition occurs."""
_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# -- the rules, sped up ---------------------------------------------------------------------------
def scaled(duration: str, factor: int) -> str:
    """A Prometheus duration divided by `factor`, in whole seconds (at least 1s)."""
    seconds = sum(int(n) * _UNIT_S[u] for n, u in _DURATION.findall(duration))
    return f"{max(1, round(seconds / factor))}s"


def fast_rules(text: str, factor: int = FAST_FACTOR) -> str:
    """The rule file with every `for:`, range window (`[10m]`) and offset divided by `factor`;
    expressions, thresholds, labels and annotations unchanged."""
    doc = yaml.safe_load(text)
    window = re.compile(r"\[(\d+[smhd])\]")
    offset = re.compile(r"offset (\d+[smhd])")
    for group in doc["groups"]:
        for rule in group["rules"]:
            expr = window.sub(lambda m: f"[{scaled(m[1], factor)}]", rule["expr"])
            rule["expr"] = offset.sub(lambda m: f"offset {scaled(m[1], factor)}", expr)
            if "for" in rule:
                rule["for"] = scaled(rule["for"], factor)
    return yaml.safe_dump(doc, sort_keys=False, width=1000)


# -- Prometheus ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen

    def query(self, expr: str) -> list[dict]:
        """The instant query's result (raises on a query error)."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        r = httpx.get(f"{self.url}/api/v1/query_range", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    def alert_states(self) -> dict[str, set[str]]:
        """Alert name -> the states of its alerts now (pending, firing); absent: inactive."""
        alerts = httpx.get(f"{self.url}/api/v1/alerts", timeout=30).json()["data"]["alerts"]
        states: dict[str, set[str]] = {}
        for alert in alerts:
            states.setdefault(alert["labels"]["alertname"], set()).add(alert["state"])
        return states

    def scraped_up(self) -> bool:
        return any(r["value"][1] == "1" for r in self.query('up{job="loraplex"}'))


@contextlib.contextmanager
def prometheus(target: str | list[str], rules_text: str, work: Path) -> Iterator[Prometheus]:
    """A Prometheus scraping `target` (host:port, or a list of them) every SCRAPE_S as job
    `loraplex`, evaluating `rules_text` as often; stopped at the end."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed: apt-get install prometheus")
    targets = [target] if isinstance(target, str) else list(target)
    work.mkdir(parents=True, exist_ok=True)
    (work / "rules.yaml").write_text(rules_text)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(work / "rules.yaml")],
        "scrape_configs": [{"job_name": "loraplex", "static_configs": [{"targets": targets}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        _wait(lambda: _ready(prom), 60, "Prometheus to be ready", proc, work / "prometheus.log")
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(prom: Prometheus) -> bool:
    try:
        return httpx.get(f"{prom.url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(predicate, timeout: float, what: str, proc=None, log: Path | None = None):
    """Poll until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited\n{log.read_text()[-3000:]}")
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


# -- the workload ----------------------------------------------------------------------------------
class Workload:
    """Requests in a loop on `threads` threads, each taking the next of `models` in turn, until
    stopped; counts the answers by status."""

    def __init__(self, url: str, models: list[str], threads: int = 2, max_tokens: int = 4):
        self.url, self.models, self.max_tokens = url, models, max_tokens
        self.statuses: dict[int, int] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Workload:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _pick(self) -> str:
        with self._lock:
            model = self.models[self._next % len(self.models)]
            self._next += 1
            return model

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                body = {
                    "model": self._pick(),
                    "prompt": "hello world",
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                status = client.post(f"{self.url}/v1/completions", json=body).status_code
                with self._lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1


# -- the dashboard's queries -----------------------------------------------------------------------
def panel_queries(dashboard: dict) -> list[tuple[dict, list[str]]]:
    """Each panel with its targets' expressions, Grafana's variables filled in for this
    Prometheus (every instance, RATE_INTERVAL)."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        exprs = [
            t["expr"]
            .replace("$__rate_interval", RATE_INTERVAL)
            .replace("${instance:regex}", ".*")
            .replace("$instance", ".*")
            for t in panel["targets"]
        ]
        out.append((panel, exprs))
    return out


# -- the world -------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve_demo_world(work: Path, max_loras: int = 2) -> Iterator[tuple[str, list[str]]]:
    """`loraplex serve` (native engine) over the demo world's base and its four adapters, with
    `max_loras` slots and the top-K adapter series on; yields its URL and the adapter names."""
    sys.path.insert(0, str(ROOT / "src"))
    from loraplex.demo.world import build_world, default_world_dir
    from loraplex.loadgen.procs import start_worker

    world = build_world(default_world_dir(), progress=False)
    names = sorted(world.adapters)
    worker = start_worker(
        world.model_dir,
        work / "worker",
        world.adapters,
        "--max-loras",
        str(max_loras),
        "--max-cpu-loras",
        str(max_loras + 1),
        "--top-k-adapter-metrics",
        "8",
        max_lora_rank=max(world.ranks.values()),
    )
    try:
        yield worker.url, names
    finally:
        worker.stop()


def target_of(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


# -- the picture -----------------------------------------------------------------------------------
def legend(template: str, labels: dict) -> str:
    """Grafana's `{{label}}` legend filled in from a series' labels."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


def render(
    prom: Prometheus, start: float, end: float, out: Path, phases: list, note: str = ""
) -> None:
    """The dashboard's panels as matplotlib plots of the range queries over [start, end]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = panel_queries(dashboard)
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 4.2, rows * 2.6), squeeze=False)
    for ax, (panel, exprs) in zip(axes.flat, panels):
        for target, expr in zip(panel["targets"], exprs):
            for series in prom.query_range(expr, start, end, 2.0):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = legend(target.get("legendFormat", ""), series["metric"])
                ax.plot(xs, ys, linewidth=1.2, label=label or None)
        for name, (a, b) in phases:
            ax.axvspan(
                a - start, b - start, alpha=0.08, color="red" if name == "thrash" else "green"
            )
        ax.set_title(panel["title"], fontsize=8)
        ax.tick_params(labelsize=6)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=5, loc="upper left")
        else:  # a panel documented as empty until its condition occurs
            words = panel.get("description", "").split(":")[0]
            ax.text(0.5, 0.5, words, ha="center", va="center", fontsize=7, transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "loraplex dashboard, drawn with matplotlib from a real Prometheus (green: a workload that"
        f" fits 2 slots, red: one that thrashes them); x: seconds\n{note}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)


def main() -> None:
    import tempfile

    out = ROOT / "docs/img/dashboard.png"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with serve_demo_world(work) as (url, names):
            rules = fast_rules(RULES.read_text())
            with prometheus(target_of(url), rules, work / "prometheus") as prom:
                _wait(prom.scraped_up, 60, "the first scrape")
                start = time.time()
                phases, notes = [], []
                for name, models, seconds in (("fit", names[:2], 40), ("thrash", names, 40)):
                    begin = time.time()
                    with Workload(url, models) as load:
                        time.sleep(seconds)
                        firing = sorted(
                            a for a, st in prom.alert_states().items() if "firing" in st
                        )
                    phases.append((name, (begin, time.time())))
                    notes.append(phase_note(name, load, time.time() - begin, firing))
                time.sleep(5)
                render(prom, start, time.time(), out, phases, "\n".join(notes))
    print("\n".join(notes))
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


def phase_note(name: str, load: Workload, seconds: float, firing: list[str]) -> str:
    """What a phase did: its requests a second (by status) and the alerts firing at its end."""
    rate = sum(load.statuses.values()) / seconds
    codes = ",".join(str(c) for c in sorted(load.statuses))
    return f"{name}: {rate:.1f} req/s ({codes}), firing at its end: {', '.join(firing) or 'none'}"


if __name__ == "__main__":
    main()
