"""`loraplex rollout` on real processes: a registry (SQLite file), two `loraplex serve` workers, a
`loraplex router` carrying checked traffic all along, and the controller as a subprocess, over the
demo world's `reverse` adapter.

In order, on one name: a good revision (the same weights, a new digest) advances through every step
to stable, its controller killed after its first step and started again; a bad one (the `rot13`
weights: wrong answers) is rolled back at its first step by the quality gate, before any traffic;
a slow one (the same weights, served by a store that takes seconds per download) is rolled back on
its TTFT ratio. Throughout, every request answers 200 with the right answer, from a revision the
audit log shows in the split at the time of the request."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from world_fleet import checked_inputs, variant

from loraplex.demo.transforms import TRANSFORMS
from loraplex.demo.world import make_prompt
from loraplex.loadgen.procs import ADMIN_TOKEN, Proc, start_router, start_together, start_worker
from loraplex.registry import Registry
from loraplex.registry.rollouts import RolloutStore

NAME = "rev"
SLOW_DOWNLOAD_S = 2.0
CLIENTS = 4  # the slow revision's loads hold up to this many requests on each worker
# Tiny windows; the ratio limits widened to 5x: on a shared 2-core machine a p99 over a few
# requests is noisy (a good revision measured 2.4x its stable's TPOT p99 over 4 requests), and the
# slow revision's first requests are 20x and more its stable's TTFT.
FAST_STEPS = [
    "--max-ttft-ratio",
    "5",
    "--max-tpot-ratio",
    "5",
    "--step-s",
    "1",
    "--min-requests",
    "8",
    "--poll-s",
    "0.2",
    "--step-timeout-s",
    "120",
    "--lease-s",
    "3",
]


class SlowStore:
    """A store over http whose every file takes `SLOW_DOWNLOAD_S` to start (the slow revision's)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        handler = functools.partial(_SlowHandler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _SlowHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        time.sleep(SLOW_DOWNLOAD_S)
        super().do_GET()

    def log_message(self, format, *args):
        pass


class Traffic:
    """Four clients sending checked prompts for NAME through the router until stopped; each answer
    kept as (status, revision served, answer right)."""

    def __init__(self, url: str, texts: list[str]):
        self.url, self.texts, self.results = url, texts, []
        self.times: list[tuple[float, float]] = []  # (sent, answered) of each result
        self.workers: list[str] = []  # the worker that answered each result
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()

    def _run(self, offset: int) -> None:
        i = offset
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                text = self.texts[i % len(self.texts)]
                i += CLIENTS
                body = {"model": NAME, "prompt": make_prompt(text), "max_tokens": 40}
                sent = time.time()
                try:
                    r = client.post(f"{self.url}/v1/completions", json={**body, "temperature": 0})
                except httpx.HTTPError as exc:  # kept as a failed request, not a dead thread
                    self.results.append((type(exc).__name__, "", False))
                    self.times.append((sent, time.time()))
                    self.workers.append("")
                    continue
                served = r.headers.get("x-loraplex-adapter", "")
                right = r.status_code == 200 and (
                    r.json()["choices"][0]["text"].strip() == TRANSFORMS["reverse"](text)
                )
                self.results.append((r.status_code, served, right))
                self.times.append((sent, time.time()))
                self.workers.append(r.headers.get("x-loraplex-worker", ""))

    def served(self) -> set[str]:
        return {served for _, served, _ in self.results}


@pytest.fixture(scope="module")
def fleet(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-e2e")
    slow = SlowStore(root / "slow-store")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    reverse, rot13 = demo_world.adapters["reverse"], demo_world.adapters["rot13"]
    texts = checked_inputs(demo_world, n=40)["reverse"]
    cases = root / "reverse-cases.jsonl"
    cases.write_text(
        "".join(
            json.dumps({"prompt": make_prompt(t), "expected": TRANSFORMS["reverse"](t)}) + "\n"
            for t in texts[:8]
        )
    )
    registry.add_revision(reverse, NAME, revision="r1", status="stable", eval_set=cases)
    registry.add_revision(variant(reverse, root / "r2", "r2"), NAME, revision="r2", eval_set=cases)
    registry.add_revision(rot13, NAME, revision="r3", eval_set=cases)
    add_slow_revision(registry, url, variant(reverse, root / "r4", "r4"), slow)
    registry.add_revision(variant(reverse, root / "r5", "r5"), NAME, revision="r5", eval_set=cases)
    token = root / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    extra = ("--max-loras", "4", "--registry", url, "--allowed-roots", slow.url)
    workers = start_together(
        [
            functools.partial(
                start_worker, demo_world.model_dir, root / f"w{i}", {}, *extra, max_lora_rank=32
            )
            for i in range(2)
        ]
    )
    router = start_router([w.url for w in workers], root / "router")
    try:
        # its address line comes before it listens (its first poll round is in between)
        wait_for(lambda: _answers(f"{router.url}/health"), 60, "the router to listen")
        yield registry, workers, router, token, texts, root
    finally:
        router.stop()
        for w in workers:
            w.stop()
        registry.close()
        slow.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def add_slow_revision(registry: Registry, url: str, src: Path, slow: SlowStore) -> None:
    """r4: registered with its storage URI on the slow store, its bytes only there."""
    with_uri = Registry(
        url,
        registry.store,
        base_model_dir=registry.registration.base_model_dir,
        max_lora_rank=32,
        storage_base=slow.url,
    )
    record = with_uri.add_revision(src, NAME, revision="r4")
    with_uri.close()
    hex_digest = record.digest.removeprefix("sha256:")
    shutil.copytree(registry.store.path(record.digest), slow.root / hex_digest)
    registry.store.remove(record.digest)


def controller(fleet, revision: str, log: Path, *extra: str) -> subprocess.Popen:
    registry, workers, _, token, _, _ = fleet
    args = [sys.executable, "-m", "loraplex.cli", "rollout", NAME, revision]
    args += ["--registry", registry.url, "--admin-token-file", str(token)]
    for w in workers:
        args += ["--worker", w.url]
    return subprocess.Popen(
        [*args, *FAST_STEPS, *extra], stdout=log.open("w"), stderr=subprocess.STDOUT, text=True
    )


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def events(registry: Registry, revision: str) -> list:
    return [e for e in registry.audit_events(1000, NAME) if e.target == f"{NAME}@{revision}"]


FEED_LAG_S = 2.0
"""How long after a registry commit a worker may still resolve by the split before it (the change
feed's delivery, on a loaded machine)."""


def split_timeline(registry: Registry) -> list[tuple[float, set[str]]]:
    """(from when, the revisions with traffic) after each change of the name's split, from the
    audit log."""
    timeline = []
    for e in reversed(registry.audit_events(1000, NAME)):
        if e.action == "add" and e.detail.get("status") == "stable":
            serving = {e.target.split("@")[1]}
        elif e.action in ("set_traffic", "promote", "quarantine"):
            serving = {rev for rev, w in e.detail["traffic"].items() if w}
        elif e.action == "rollback":
            serving = {e.detail["to"]}
        else:
            continue
        timeline.append((e.at.timestamp(), serving))
    return timeline


def in_split(timeline, revision: str, sent: float, answered: float) -> bool:
    """The revision served traffic at some moment from FEED_LAG_S before the request to its
    answer."""
    for i, (start, serving) in enumerate(timeline):
        end = timeline[i + 1][0] if i + 1 < len(timeline) else float("inf")
        if revision in serving and start <= answered and end >= sent - FEED_LAG_S:
            return True
    return False


def test_good_bad_and_slow_revisions_with_a_killed_controller(fleet):
    registry, workers, router, token, texts, root = fleet
    with Traffic(router.url, texts) as traffic:
        wait_for(lambda: len(traffic.results) >= 10, 120, "traffic on r1")
        # 1. The good revision; its controller killed once its first step has advanced.
        first = controller(fleet, "r2", root / "controller-1.log", "--steps", "20,50,100")
        wait_for(
            lambda: any(e.action == "rollout_advance" for e in events(registry, "r2")),
            180,
            "r2's first step to advance",
        )
        first.send_signal(signal.SIGKILL)
        first.wait()
        split = dict(registry.show(NAME).traffic)
        assert split in ({"r2": 20, "r1": 80}, {"r2": 50, "r1": 50}), split  # whole, as it was
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "loraplex.cli",
                "rollout",
                "status",
                NAME,
                "--registry",
                registry.url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "controller: none" in status.stdout, status.stdout + status.stderr
        second = controller(fleet, "r2", root / "controller-2.log", "--steps", "20,50,100")
        assert second.wait(timeout=240) == 0, (root / "controller-2.log").read_text()
        assert registry.show(NAME).traffic == (("r2", 100),)
        actions = [e.action for e in reversed(events(registry, "r2"))]
        assert "rollout_resume" in actions and actions[-1] == "rollout_promote"
        advances = [e for e in events(registry, "r2") if e.action == "rollout_advance"]
        assert {e.detail["weight"] for e in advances} == {20, 50}
        assert all(e.detail["quality"]["canary"] == "8/8" for e in advances)
        assert all(e.detail["canary"]["requests"] >= 8 for e in advances)
        # 2. The bad revision: the quality gate refuses it before it gets any traffic.
        bad = controller(fleet, "r3", root / "controller-bad.log", "--steps", "20,50,100")
        assert bad.wait(timeout=240) == 3, (root / "controller-bad.log").read_text()
        record = RolloutStore(registry).get(NAME)
        assert record.phase == "rolled_back" and "eval set passed 0/8" in record.reason
        assert record.step == 0
        gate = next(e for e in events(registry, "r3") if e.action == "rollout_rollback")
        assert gate.detail["quality"]["stable"] == "8/8"
        # 3. The slow revision: no prewarm, no gate; its first requests wait for its store.
        slow = controller(
            fleet,
            "r4",
            root / "controller-slow.log",
            "--steps",
            "50,100",
            "--no-quality-gate",
            "--canary-share",
            "0",
        )
        assert slow.wait(timeout=240) == 3, (root / "controller-slow.log").read_text()
        record = RolloutStore(registry).get(NAME)
        assert record.phase == "rolled_back" and "TTFT p" in record.reason, record.reason
        decision = next(e for e in events(registry, "r4") if e.action == "rollout_rollback")
        assert decision.detail["step"] == 1 and decision.detail["ratios"]["ttft_p99"] > 1.5
        assert decision.detail["canary"]["ttft_p99_ms"] >= SLOW_DOWNLOAD_S * 1000
        assert registry.show(NAME).traffic == (("r2", 100),)
    statuses = {status for status, _, _ in traffic.results}
    assert statuses == {200}, statuses
    assert all(right for _, _, right in traffic.results)
    timeline = split_timeline(registry)
    outside = [
        (served, sent)
        for (_, served, _), (sent, answered) in zip(traffic.results, traffic.times)
        if not in_split(timeline, served.split("@")[1], sent, answered)
    ]
    assert not outside, (outside[:5], timeline)
    served = {s.split("@")[1] for s in traffic.served()}
    assert "r3" not in served and {"r1", "r2", "r4"} <= served


def test_the_canary_pool_takes_the_canarys_share_through_a_router_with_the_registry(fleet):
    """r5 rolled out with one worker as its pool, behind a router that reads the registry: the
    pool's worker prewarms it, and every request the router sends it lands there."""
    registry, workers, _, token, texts, root = fleet
    pool, other = workers
    args = ["router", "--port", "0", "--admin-token-file", str(token), "--registry", registry.url]
    # room for this traffic on one worker, whatever its queue does while the canary loads
    args += ["--saturation-waiting", "50"]
    router = Proc([*args, "--worker", pool.url, "--worker", other.url], root / "router-2.log")
    try:
        wait_for(lambda: _answers(f"{router.url}/health"), 60, "the second router to listen")
        with Traffic(router.url, texts) as traffic:
            wait_for(lambda: len(traffic.results) >= 6, 120, "traffic through the second router")
            run = controller(
                fleet,
                "r5",
                root / "controller-pool.log",
                "--step-s",
                "8",
                "--steps",
                "50,100",
                "--canary-workers",
                pool.url,
            )
            assert run.wait(timeout=240) == 0, (root / "controller-pool.log").read_text()
    finally:
        router.stop()
    assert registry.show(NAME).traffic == (("r5", 100),)
    changes = [
        e
        for e in reversed(registry.audit_events(1000, NAME))
        if "r5" in (e.detail.get("traffic") or {})
    ]
    split_at = next(e.at.timestamp() for e in changes if e.action == "set_traffic")
    promoted_at = next(e.at.timestamp() for e in changes if e.action == "promote")
    # from when the router has read the split (it reads it at most once a second) to the promotion
    during = [
        worker
        for (status, served, _), worker, (sent, _) in zip(
            traffic.results, traffic.workers, traffic.times
        )
        if served == f"{NAME}@r5" and split_at + FEED_LAG_S < sent < promoted_at
    ]
    assert len(during) >= 8 and set(during) == {pool.url}, (len(during), set(during))
    assert all(status == 200 and right for status, _, right in traffic.results)
