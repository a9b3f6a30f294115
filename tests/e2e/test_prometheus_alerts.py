"""The shipped alert rules and dashboard against a real Prometheus scraping a real `loraplex serve`
(native engine, the demo world's four adapters, 2 slots) every second: under a workload that fits
the slots the thrash and eviction alerts stay inactive; under one that thrashes them (four hot
adapters) they fire; every dashboard panel's queries run on the data and return series."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prometheus_proof import (  # noqa: E402
    DASHBOARD,
    EMPTY_MARK,
    RULES,
    Workload,
    _wait,
    fast_rules,
    panel_queries,
    prometheus,
    serve_demo_world,
    target_of,
)

THRASH_ALERTS = (
    "LoraplexAdapterThrash",
    "LoraplexReloadsAfterEviction",
    "LoraplexGpuEvictionsHigh",
    "LoraplexCpuEvictionsHigh",
)


def settle_s(rules_text: str, names: tuple[str, ...]) -> int:
    """The longest range window plus `for:` among the named rules (seconds): how long a workload
    must run before those rules could fire."""
    longest = 0
    for group in yaml.safe_load(rules_text)["groups"]:
        for rule in group["rules"]:
            if rule["alert"] in names:
                windows = [int(w) for w in re.findall(r"\[(\d+)s\]", rule["expr"])]
                longest = max(longest, max(windows) + int(rule.get("for", "0s")[:-1]))
    return longest


@pytest.fixture(scope="module")
def proof(demo_world, tmp_path_factory):
    """The run: a fitting workload while the alerts are sampled every second, then a thrashing one
    until the thrash alerts fire. Yields (prometheus, states seen under the fit, under thrash)."""
    work = tmp_path_factory.mktemp("prometheus-proof")
    rules = fast_rules(RULES.read_text())
    with serve_demo_world(work) as (url, names):
        assert len(names) == 4
        with prometheus(target_of(url), rules, work / "prometheus") as prom:
            _wait(prom.scraped_up, 60, "the first scrape")
            quiet: list[dict[str, set[str]]] = []
            with Workload(url, names[:2]) as fit:
                end = time.monotonic() + settle_s(rules, THRASH_ALERTS) + 5
                while time.monotonic() < end:
                    quiet.append(prom.alert_states())
                    time.sleep(1)
            assert set(fit.statuses) == {200} and sum(fit.statuses.values()) > 20

            def all_firing():
                states = prom.alert_states()
                return states if all("firing" in states.get(a, ()) for a in THRASH_ALERTS) else None

            with Workload(url, names) as thrash:
                firing = _wait(all_firing, 120, "the thrash alerts to fire")
            assert set(thrash.statuses) == {200}
            yield prom, quiet, firing


def test_thrash_and_eviction_alerts_stay_inactive_while_the_workload_fits(proof):
    _, quiet, _ = proof
    assert len(quiet) > 20
    for states in quiet:
        assert not any(a in states for a in THRASH_ALERTS), states


def test_thrash_and_eviction_alerts_fire_when_adapters_outnumber_slots(proof):
    prom, _, firing = proof
    assert all("firing" in firing[a] for a in THRASH_ALERTS)
    ratio = prom.query(
        "sum(rate(loraplex_adapter_reload_after_eviction_total[10s]))"
        ' / sum(rate(loraplex_adapter_evictions_total{tier="gpu"}[10s]))'
    )
    assert float(ratio[0]["value"][1]) > 0.5


def test_every_panel_query_runs_and_returns_series(proof):
    prom, _, _ = proof
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel, exprs in panel_queries(dashboard):
        results = [prom.query(e) for e in exprs]  # raises on a query error
        if not any(results):
            empty.append(panel["title"])
    documented = [
        p["title"] for p in dashboard["panels"] if p.get("description", "").startswith(EMPTY_MARK)
    ]
    assert set(empty) <= set(documented), f"empty and not documented so: {empty}"


def test_rank_and_top_k_panels_show_the_worlds_adapters(proof, demo_world):
    prom, _, _ = proof
    tpot = prom.query(
        "histogram_quantile(0.99, sum by (rank_bucket, le)"
        " (rate(loraplex_request_tpot_by_rank_seconds_bucket[1m])))"
    )
    seen = {r["metric"]["rank_bucket"] for r in tpot if not math.isnan(float(r["value"][1]))}
    from loraplex.engines.rank_skew import rank_bucket

    assert seen == {rank_bucket(r) for r in demo_world.ranks.values()}
    top = prom.query("sum by (adapter) (loraplex_adapter_generated_tokens_total)")
    assert {r["metric"]["adapter"] for r in top} == set(demo_world.adapters)
