"""The model-server protocol of the llm-d Endpoint Picker: a real server under load, its /metrics
read with the EPP's rules (epp_rules.py), and the figures checked against the server's own state
(/admin/state)."""

from __future__ import annotations

import threading
import time

import httpx
import yaml
from epp_rules import extract, lora_affinity, parse
from harness import ADMIN_TOKEN, KEYS, MODEL, variant
from typer.testing import CliRunner

from loraplex.registry.cli import app as registry_cli
from loraplex.rollout import workers

NO_EOS = {"ignore_eos": True}


def _complete(running, tenant: str, model: str, max_tokens: int, results: list) -> None:
    response = httpx.post(
        f"{running.url}/v1/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        json={"model": model, "prompt": "abc", "max_tokens": max_tokens, **NO_EOS},
    )
    results.append((model, response.status_code, response.headers.get("x-loraplex-adapter")))


def _send(
    running, tenant: str, model: str, n: int, max_tokens: int, results: list
) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_complete, args=(running, tenant, model, max_tokens, results))
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    return threads


def _figures(state: dict) -> tuple:
    load = state["load"]
    tiers = sorted((a["model"], a["tier"]) for a in state["adapters"])
    return load["waiting"], load["running"], load["kv_cache_usage"], tiers


def _steady_scrape(running, until) -> tuple[dict, str, float, float]:
    """State, /metrics, state again, until both states agree and `until(state)` holds: then the
    scrape between them saw the same figures (while requests only decode, KV usage only grows, so
    equal ends mean no change)."""

    def attempt():
        before = running.state()
        t0 = time.time()
        text = httpx.get(f"{running.url}/metrics", timeout=30).text
        t1 = time.time()
        after = running.state()
        if _figures(before) == _figures(after) and until(before):
            return before, text, t0, t1
        return None

    return running.wait_for(attempt, timeout=60, what="a steady state to scrape")


def test_the_epp_reads_the_real_running_waiting_queue_and_kv_figures(start):
    # One slot: shared-a's long requests hold it, so alice-a's requests wait; blocks of 64
    # tokens keep the KV figure still for 64 decode steps at a time.
    with start(engine={"max_loras": 1, "block_size": 64}, lora_load_state_metrics=1) as running:
        results: list = []
        for t in _send(running, "alice", "shared-a", 1, 1, results):  # warm: shared-a in the slot
            t.join()
        threads = _send(running, "alice", "shared-a", 3, 240, results)
        running.wait_for(lambda: running.state()["load"]["running"] == 3, what="3 running")
        threads += _send(running, "alice", "alice-a", 2, 4, results)
        state, text, t0, t1 = _steady_scrape(
            running, lambda s: s["load"]["waiting"] == 2 and s["load"]["running"] == 3
        )

        m = extract(text)
        load = state["load"]
        epp = (m.waiting_queue_size, m.running_requests_size)
        assert epp == (load["waiting"], load["running"]) == (2, 3)
        assert m.kv_cache_usage_percent == load["kv_cache_usage"] > 0
        in_slots = {a["model"] for a in state["adapters"] if a["tier"] == "gpu"}
        assert m.active_models == in_slots == {"shared-a"}
        assert m.waiting_models == {"alice-a"}
        assert m.max_active_models == state["max_loras"] == 1
        # The one series is the current one: its value is the time of the read.
        assert t0 <= m.lora_info_value <= t1
        assert [lora_affinity(m, a) for a in ("shared-a", "alice-a", "bob-a")] == [1.0, 0.6, 0.0]

        # The load-state series (top 1): the adapter in the slot, at its rank, and the slot counts.
        families = parse(text)
        loaded = families["vllm:lora_adapter_loaded"][1]
        assert [s.labels for s in loaded] == [
            {"adapter_name": "shared-a", "level": "gpu", "pinned": "false", "rank": "8"}
        ]
        assert families["vllm:num_gpu_loaded_lora_adapters"][1][0].value == 1
        assert families["vllm:max_gpu_lora_adapters"][1][0].value == 1
        for t in threads:
            t.join()
        assert [code for _, code, _ in results] == [200] * 6

        idle = extract(httpx.get(f"{running.url}/metrics", timeout=30).text)
        assert idle.waiting_queue_size == idle.running_requests_size == 0
        assert idle.waiting_models == set()


def test_without_the_flag_there_are_no_load_state_series(running):
    families = parse(httpx.get(f"{running.url}/metrics", timeout=30).text)
    assert "vllm:lora_adapter_loaded" not in families
    assert "vllm:max_gpu_lora_adapters" not in families
    assert families["vllm:lora_requests_info"][1][0].labels["max_lora"] == "2"


def test_a_canary_is_exported_as_rewrites_whose_targets_are_served_and_reported(
    start, llama_adapters, tmp_path
):
    """`registry export k8s` writes the registry's split; each target name is served as that
    revision, and a resident revision of a split name is reported under the target's name, so
    lora-affinity finds it."""

    def canary(registry):
        registry.add_revision(
            variant(llama_adapters["attn-r8"], tmp_path / "v2", 1.5), "shared-a", revision="r2"
        )
        registry.promote("shared-a", "r2", 20, force=True)

    with start(registry_setup=canary) as running:
        db = running.tmp / "registry.db"
        out = CliRunner().invoke(
            registry_cli,
            [
                "--registry",
                f"sqlite:///{db}",
                "--store",
                str(running.tmp / "artifacts"),
                "export",
                "k8s",
                "--pool",
                "lp",
            ],
        )
        assert out.exit_code == 0, out.output
        rewrites = {
            o["spec"]["rules"][0]["matches"][0]["model"]["value"]: o
            for o in yaml.safe_load_all(out.output)
        }
        assert set(rewrites) == {"shared-a", "alice-a", "bob-a"}
        targets = rewrites["shared-a"]["spec"]["rules"][0]["targets"]
        assert sorted((t["modelRewrite"], t["weight"]) for t in targets) == [
            ("shared-a@r1", 80),
            ("shared-a@r2", 20),
        ]
        assert rewrites["bob-a"]["spec"]["rules"][0]["targets"] == [
            {"modelRewrite": "bob-a", "weight": 100}
        ]
        assert rewrites["shared-a"]["spec"]["poolRef"]["name"] == "lp"

        for target in targets:
            results: list = []
            for t in _send(running, "bob", target["modelRewrite"], 1, 2, results):
                t.join()
            assert results == [(target["modelRewrite"], 200, target["modelRewrite"])]
        m = extract(httpx.get(f"{running.url}/metrics", timeout=30).text)
        assert m.active_models == {"shared-a@r1", "shared-a@r2"}
        assert lora_affinity(m, "shared-a@r2") == 1.0 and lora_affinity(m, "shared-a") == 0.0

        cards = httpx.get(
            f"{running.url}/v1/models", headers={"Authorization": f"Bearer {KEYS['bob']}"}
        ).json()
        assert {(c["id"], c["parent"]) for c in cards["data"]} == {
            (MODEL, None),
            ("shared-a", MODEL),
            ("bob-a", MODEL),
        }


def test_export_refuses_a_pool_that_is_not_a_kubernetes_name(tmp_path):
    out = CliRunner().invoke(
        registry_cli, ["--data-dir", str(tmp_path), "export", "k8s", "--pool", "Bad_Pool"]
    )
    assert out.exit_code == 1
    assert "--pool 'Bad_Pool': not a Kubernetes name" in out.output


def test_a_rollouts_canary_pool_is_where_the_epps_lora_affinity_sends_the_canary(
    start, llama_adapters, tmp_path
):
    """Behind the llm-d EPP, a rollout's canary pool is the pods its lora-affinity scorer prefers
    for the canary's rewritten name: the controller's pool preparation (`rollout.workers.prewarm`
    and `wait_active`, run before any canary traffic) puts the revision in a device slot, and the
    pod then reports it as active; a pod outside the pool does not."""

    def canary(registry):
        registry.add_revision(
            variant(llama_adapters["attn-r8"], tmp_path / "v2", 1.5), "shared-a", revision="r2"
        )
        registry.promote("shared-a", "r2", 1, force=True)

    with start(registry_setup=canary) as running:
        before = extract(httpx.get(f"{running.url}/metrics", timeout=30).text)
        assert "shared-a@r2" not in before.active_models  # no request has asked for it yet
        assert lora_affinity(before, "shared-a@r2") < 1.0
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with httpx.Client(headers=admin, timeout=60) as client:
            workers.prewarm(client, (running.url,), "shared-a", "r2")
            assert workers.wait_active(client, (running.url,), "shared-a", "r2", 60) == []
        after = extract(httpx.get(f"{running.url}/metrics", timeout=30).text)
        assert "shared-a@r2" in after.active_models
        assert lora_affinity(after, "shared-a@r2") == 1.0
        # the stable's name is reported as its own target, not as the canary's
        assert lora_affinity(after, "shared-a@r1") < 1.0
