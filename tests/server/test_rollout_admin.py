"""What a rollout controller reads from a worker: per-revision figures of a split name (JSON and
Prometheus series, gone once the split ends) and an eval set run with a chosen revision."""

from __future__ import annotations

import json

import httpx
from harness import ADMIN_TOKEN

from loraplex.rollout.figures import BOUNDS_S, RevisionFigures


def split_setup(llama_adapters, tmp_path_factory):
    cases = tmp_path_factory.mktemp("eval") / "cases.jsonl"
    lines = [{"prompt": "hello", "contains": ""}]
    lines += [{"prompt": f"x{i}", "expected": "never this"} for i in range(5)]
    cases.write_text("".join(json.dumps(c) + "\n" for c in lines))

    def setup(registry):
        registry.add_revision(llama_adapters["mlp-r4"], "shared-a", revision="r2", eval_set=cases)
        registry.promote("shared-a", "r2", 50, force=True)

    return setup


def test_figures_of_a_split_name_per_revision_then_gone(start, llama_adapters, tmp_path_factory):
    with start(registry_setup=split_setup(llama_adapters, tmp_path_factory)) as running:
        client = running.client()
        seen = {}
        for i in range(12):
            r = client.completions.with_raw_response.create(
                model="shared-a", prompt=f"hi {i}", max_tokens=2
            )
            revision = r.headers["x-loraplex-adapter"].split("@")[1]
            seen[revision] = seen.get(revision, 0) + 1
        body = running.admin("GET", "/admin/revisions", params={"name": "shared-a"}).json()
        assert body["bounds_s"] == list(BOUNDS_S)
        figures = {
            rev: RevisionFigures.from_json(f) for rev, f in body["adapters"]["shared-a"].items()
        }
        assert {rev: f.requests for rev, f in figures.items()} == seen
        assert all(f.errors == 0 and f.ttft.total == f.requests for f in figures.values())
        metrics = httpx.get(f"{running.url}/metrics").text
        for rev, n in seen.items():
            labels = f'{{adapter="shared-a",revision="{rev}"}}'
            assert f"loraplex_revision_requests_total{labels} {n:.1f}" in metrics
            count = f"loraplex_revision_ttft_seconds_count{labels}"
            assert f"{count} {n:.1f}" in metrics
        assert "bob-a" not in json.dumps(body)  # names not split have none
        running.registry.set_traffic("shared-a", {"r2": 100}, force=True)
        running.server.follow_traffic()
        client.completions.create(model="shared-a", prompt="after", max_tokens=1)
        after = running.admin("GET", "/admin/revisions").json()
        assert after["adapters"] == {}
        assert "loraplex_revision_requests_total{" not in httpx.get(f"{running.url}/metrics").text


def test_eval_runs_a_revisions_cases_with_the_revision_named(
    start, llama_adapters, tmp_path_factory
):
    with start(registry_setup=split_setup(llama_adapters, tmp_path_factory)) as running:
        r = running.admin("POST", "/admin/adapters/shared-a/eval", json={"revision": "r2"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["passed"], body["total"], body["model"]) == (1, 6, "shared-a@r2")
        assert [f["prompt"] for f in body["failures"]] == [f"x{i}" for i in range(5)]  # each one
        assert {f["want"] for f in body["failures"]} == {"never this"}
        stable = running.admin(
            "POST", "/admin/adapters/shared-a/eval", json={"revision": "r1", "cases_of": "r2"}
        ).json()
        assert (stable["model"], stable["total"]) == ("shared-a@r1", 6)
        none = running.admin("POST", "/admin/adapters/shared-a/eval", json={"revision": "r1"})
        assert none.status_code == 409 and "has no eval set" in none.json()["error"]["message"]
        unknown = running.admin("POST", "/admin/adapters/shared-a/eval", json={"revision": "r9"})
        assert unknown.status_code == 404
        anon = httpx.post(f"{running.url}/admin/adapters/shared-a/eval", json={"revision": "r2"})
        assert anon.status_code == 401
        assert ADMIN_TOKEN not in anon.text
