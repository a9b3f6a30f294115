"""The rollout's Prometheus source against a real Prometheus scraping two real servers every
second: the per-revision series of a split name, read back by PromQL at a window's start and end,
give the fleet's counts and merged histograms exactly as the workers' own figures, merged by the
controller, do."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "server"))
from harness import ADMIN_TOKEN, KEYS, MODEL, api_keys, make_registry, serving  # noqa: E402
from prometheus_proof import _wait, prometheus, target_of  # noqa: E402

from loraplex.engines.native.config import EngineConfig  # noqa: E402
from loraplex.engines.native.llm_engine import LLMEngine  # noqa: E402
from loraplex.rollout.figures import RevisionFigures  # noqa: E402
from loraplex.rollout.sources import PrometheusSource, WorkerSource  # noqa: E402
from loraplex.server.app import ServerConfig, create_app  # noqa: E402


def scraped(prom) -> float:
    """The requests counted at Prometheus' last scrape."""
    rows = prom.query("sum(loraplex_revision_requests_total)")
    return float(rows[0]["value"][1]) if rows else 0.0


def test_promql_figures_match_the_workers(llama_dir, llama_adapters, tmp_path):
    registry = make_registry(tmp_path, llama_dir, llama_adapters)
    registry.add_revision(llama_adapters["mlp-r4"], "shared-a", revision="r2")
    registry.promote("shared-a", "r2", 50, force=True)

    def app():
        engine = LLMEngine(
            EngineConfig(
                model_dir=llama_dir,
                dtype="float32",
                max_loras=2,
                max_lora_rank=16,
                kv_cache_memory_bytes=8 * 2**20,
            )
        )
        config = ServerConfig(MODEL, admin_token=ADMIN_TOKEN)
        return create_app(engine, registry, config, api_keys())

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        with serving(app()) as one, serving(app()) as two:
            urls = (one, two)
            targets = [target_of(u) for u in urls]
            with prometheus(targets, "groups: []\n", tmp_path / "prom") as prom:
                from_prometheus, from_workers = _window(prom, urls, admin)
    finally:
        registry.close()
    assert sum(f.requests for f in from_workers.values()) == 30
    assert set(from_prometheus) == set(from_workers) == {"r1", "r2"}
    for revision, exact in from_workers.items():
        seen: RevisionFigures = from_prometheus[revision]
        assert seen.errors == 0
        assert seen.requests == exact.requests
        assert seen.ttft.counts == exact.ttft.counts and seen.tpot.counts == exact.tpot.counts
        assert seen.ttft.quantile(0.99) == exact.ttft.quantile(0.99)


def _window(prom, urls, admin) -> tuple[dict, dict]:
    """Requests spread over both servers, then one window's figures from either source."""
    clients = [
        openai.OpenAI(base_url=f"{u}/v1", api_key=KEYS["alice"], max_retries=0) for u in urls
    ]
    for i in range(6):  # the series exist on both servers before the window starts
        clients[i % 2].completions.create(
            model="shared-a", prompt=f"a{i}", max_tokens=2, user=f"u{i}"
        )
    _wait(lambda: scraped(prom) >= 6, 60, "a scrape of the first requests")
    time.sleep(1.5)
    with httpx.Client(headers=admin, timeout=30) as http:
        promql, workers = PrometheusSource(prom.url, http), WorkerSource(tuple(urls), http)
        mark, worker_mark = promql.mark("shared-a"), workers.mark("shared-a")
        for i in range(30):
            clients[i % 2].completions.create(
                model="shared-a", prompt=f"b{i}", max_tokens=3, user=f"v{i}"
            )
        _wait(lambda: scraped(prom) >= 36, 60, "a scrape of the window's requests")
        time.sleep(1.5)
        from_prometheus = promql.since(mark, "shared-a")
        from_workers = workers.since(worker_mark, "shared-a")
    return from_prometheus, from_workers
