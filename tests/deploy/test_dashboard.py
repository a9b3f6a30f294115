"""The Grafana dashboard holds the fields Grafana needs to import it, takes its data source from a
variable (no data-source uid of one installation), and reads only series that loraplex exports
and docs/metrics.md describes (as do the alert rules)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy/grafana/loraplex.json").read_text())
RULES = (ROOT / "deploy/prometheus/loraplex-rules.yaml").read_text()
DOC = (ROOT / "docs/metrics.md").read_text()
PANEL_TYPES = {"timeseries", "stat", "row"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# a histogram's or counter's series as the doc names its family
_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def test_the_fields_grafana_requires():
    for field in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert field in DASHBOARD, field
    assert isinstance(DASHBOARD["schemaVersion"], int) and DASHBOARD["schemaVersion"] >= 36
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    for panel in DASHBOARD["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"]
        pos = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(pos) and all(isinstance(v, int) for v in pos.values())
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
    for panel in panels():
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_panels_do_not_overlap():
    taken = set()
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells


def test_data_source_and_worker_are_variables():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["datasource"] == DATASOURCE
    assert instance["includeAll"] and instance["multi"]
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["refId"])
    uids = re.findall(r'"uid":\s*"([^"]*)"', json.dumps(DASHBOARD))
    assert set(uids) == {"${datasource}", DASHBOARD["uid"]}


def test_the_issues_panels_are_there():
    titles = " | ".join(p["title"] for p in panels()).lower()
    for words in (
        "resident per tier",
        "hit ratio by level",
        "load latency by stage",
        "ttft warm vs cold",
        "tpot",
        "evictions",
        "thrash",
        "cold starts",
        "tenant residency against budget",
        "queue and running",
        "top-k adapters",
        "rank against tpot",
    ):
        assert words in titles, words


def series_names(text: str) -> set[str]:
    return set(re.findall(r"\b(?:loraplex_|vllm:)[a-z0-9_:]+", text))


def test_every_series_read_is_documented():
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    names = series_names(exprs) | series_names(RULES)
    assert len(names) > 25
    for name in names:
        family = _SUFFIX.sub("", name)  # a histogram's series are documented by its name
        assert f"`{name}`" in DOC or f"`{family}`" in DOC, name
