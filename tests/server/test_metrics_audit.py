"""/metrics counters match the calls made; the audit log has one line per request and never the
text."""

import json

import httpx
import openai
import pytest
from harness import MODEL
from prometheus_client.parser import text_string_to_metric_families

SECRET = "SECRET-PROMPT-TEXT"
NO_EOS = {"ignore_eos": True}  # the counts below assume every request runs to max_tokens


def _samples(url: str) -> dict[tuple, float]:
    """(name, sorted label items) -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served(start):
    """A fresh server and a known set of calls: 3 ok, 1 denied (404), 1 unknown (404), 1 bad (400),
    1 no key."""
    with start() as running:
        client = running.client("alice")
        # adapter from disk
        client.completions.create(model="shared-a", prompt=SECRET, max_tokens=2, extra_body=NO_EOS)
        # now in a slot
        client.completions.create(model="shared-a", prompt=SECRET, max_tokens=2, extra_body=NO_EOS)
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": SECRET}],
            max_tokens=2,
            extra_body=NO_EOS,
        )
        for model in ("bob-a", "nothing-here"):
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model=model, prompt=SECRET)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=SECRET, max_tokens=-1)
        httpx.post(f"{running.url}/v1/completions", json={"model": MODEL, "prompt": SECRET})
        yield running


def test_request_counters_by_tenant_and_code(served):
    s = _samples(served.url)
    assert _value(s, "loraplex_requests_total", tenant="alice", code="200") == 3
    assert _value(s, "loraplex_requests_total", tenant="alice", code="404") == 2
    assert _value(s, "loraplex_requests_total", tenant="alice", code="400") == 1
    assert _value(s, "loraplex_requests_total", tenant="unauthenticated", code="401") == 1
    # Another tenant's adapter and a name that does not exist count alike, as their 404s are alike:
    # a different count would tell a tenant reading /metrics which private names exist.
    assert _value(s, "loraplex_tenant_denied_total", tenant="alice") == 2


def test_cache_series_follow_the_adapter_loads(served):
    s = _samples(served.url)
    assert _value(s, "loraplex_adapter_cache_hits_total", tier="disk") == 1
    assert _value(s, "loraplex_adapter_cache_hits_total", tier="gpu") == 1
    assert _value(s, "loraplex_adapter_cache_misses_total") == 0
    assert _value(s, "loraplex_cold_starts_total") == 1
    # each adapter request's name → revision → key
    assert _value(s, "loraplex_adapter_resolve_seconds_count") == 2
    assert _value(s, "loraplex_adapter_disk_load_seconds_count") == 1
    assert _value(s, "loraplex_adapter_activation_seconds_count") == 1
    assert _value(s, "loraplex_adapter_resident_count", tier="gpu") == 1
    assert _value(s, "loraplex_adapter_resident_bytes", tier="gpu") > 0
    # Its host copy is kept while it is in a slot, and it is on local disk: it counts in each tier
    # that holds a copy (only its top tier counted, so cpu read 0 bytes while host memory held the
    # adapter).
    used = served.state()["cache"]["cpu_bytes_used"]
    assert _value(s, "loraplex_adapter_resident_count", tier="cpu") == 1
    assert (
        _value(s, "loraplex_adapter_resident_bytes", tier="cpu")
        == used
        == _value(s, "loraplex_adapter_resident_bytes", tier="gpu")
    )
    assert _value(s, "loraplex_adapter_resident_count", tier="disk") >= 1
    assert _value(s, "loraplex_adapter_thrash_ratio") == 0
    assert _value(s, "loraplex_request_ttft_seconds_count", tier="disk") == 1
    assert _value(s, "loraplex_request_ttft_seconds_count", tier="gpu") == 2
    assert _value(s, "loraplex_request_tpot_seconds_count") == 3
    assert _value(s, "loraplex_request_queue_wait_seconds_count") >= 1


def test_every_architecture_series_and_the_gateway_series_are_exported(served):
    names = {name for name, _ in _samples(served.url)}
    for series in (
        "adapter_cache_hits_total",
        "adapter_cache_misses_total",
        "adapter_resident_count",
        "adapter_resident_bytes",
        "adapter_resolve_seconds_count",
        "adapter_disk_load_seconds_count",
        "adapter_remote_download_seconds_count",
        "adapter_h2d_seconds_count",
        "adapter_activation_seconds_count",
        "adapter_reload_after_eviction_total",
        "adapter_thrash_ratio",
        "request_ttft_seconds_count",
        "request_tpot_seconds_count",
        "request_queue_wait_seconds_count",
        "requests_total",
        "cold_starts_total",
        "tenant_denied_total",
    ):
        assert f"loraplex_{series}" in names, series
    s = _samples(served.url)
    info = [labels for (name, labels) in s if name == "vllm:lora_requests_info"]
    assert dict(info[0]) == {
        "running_lora_adapters": "shared-a",
        "waiting_lora_adapters": "",
        "max_lora": "2",
    }
    assert (
        _value(s, "vllm:num_requests_waiting") == 0 and _value(s, "vllm:num_requests_running") == 0
    )
    assert _value(s, "vllm:kv_cache_usage_perc") == 0


def test_audit_log_has_one_line_per_request_and_no_text(served):
    text = (served.tmp / "audit.jsonl").read_text()
    assert SECRET not in text
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["status"] for r in rows] == [200, 200, 200, 404, 404, 400, 401]
    # which refusal, for an operator
    assert [r["error_code"] for r in rows] == [
        None,
        None,
        None,
        "model_not_found",
        "model_not_found",
        "invalid_value",
        "invalid_api_key",
    ]
    first = rows[0]
    assert (
        first["tenant"] == "alice" and first["adapter"] == "shared-a" and first["revision"] == "r1"
    )
    assert (
        first["cache_tier"] == "disk"
        and first["rank"] == 8
        and first["digest"].startswith("sha256:")
    )
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 2
    assert first["ttft_ms"] > 0 and first["base_model"] == MODEL
    # the stages its tier went through, and its own first one (name → revision → key; ARCHITECTURE
    # lists it)
    assert (
        set(first["load_ms"]) == {"resolve", "disk", "h2d", "activation"}
        and first["load_ms"]["resolve"] >= 0
    )
    assert rows[1]["cache_tier"] == "gpu" and rows[1]["load_ms"] is None
    assert rows[2]["adapter"] is None and rows[2]["endpoint"] == "chat.completions"
    assert len({r["request_id"] for r in rows}) == len(rows)


def test_a_request_of_several_prompts_is_one_cache_lookup(start):
    """The cache series count client requests: three prompts for a cold adapter are one disk hit
    (not a disk hit and two gpu hits, as each prompt reaching the cache after the first one loaded
    the adapter)."""
    with start() as running:
        running.client("alice").completions.create(
            model="shared-a", prompt=["a", "b", "c"], max_tokens=2, extra_body=NO_EOS
        )
        s = _samples(running.url)
        assert _value(s, "loraplex_adapter_cache_hits_total", tier="disk") == 1
        assert _value(s, "loraplex_adapter_cache_hits_total", tier="gpu") == 0
        assert _value(s, "loraplex_requests_total", tenant="alice", code="200") == 1


def test_a_request_refused_while_draining_is_counted_for_its_tenant(start):
    with start() as running:
        running.server.begin_shutdown()
        with pytest.raises(openai.APIStatusError) as refused:
            running.client("alice").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert refused.value.status_code == 503
        s = _samples(running.url)
        assert _value(s, "loraplex_requests_total", tenant="alice", code="503") == 1
        row = json.loads((running.tmp / "audit.jsonl").read_text().splitlines()[-1])
        assert row["tenant"] == "alice" and row["status"] == 503 and row["error_code"]


def test_metrics_can_require_a_token(start):
    """/metrics names the running adapters (the Gateway API series) and every tenant:
    `--metrics-token-file` keeps it from whoever can reach the port."""
    token = "metrics-token-0123456789"
    with start(metrics_token=token) as running:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            refused = httpx.get(f"{running.url}/metrics", headers=headers)
            assert (
                refused.status_code == 401
                and refused.json()["error"]["code"] == "invalid_metrics_token"
            )
        shown = httpx.get(f"{running.url}/metrics", headers={"Authorization": f"Bearer {token}"})
        assert shown.status_code == 200 and "loraplex_requests_total" in shown.text


def test_prefix_cache_series_count_the_tokens_looked_up_and_found(start):
    """vLLM's `vllm:prefix_cache_queries` and `_hits`, in tokens: a prompt sent again finds its
    full blocks (all but the last token, which is computed for its logits)."""
    with start() as running:
        client = running.client("alice")
        prompt = list(range(3, 3 + 70))  # 70 tokens: 4 full blocks of 16, and 6 more
        before = _samples(running.url)
        for _ in range(2):
            client.completions.create(model="alice-a", prompt=prompt, max_tokens=1)
        after = _samples(running.url)
    queries = _value(after, "vllm:prefix_cache_queries_total") - _value(
        before, "vllm:prefix_cache_queries_total"
    )
    hits = _value(after, "vllm:prefix_cache_hits_total") - _value(
        before, "vllm:prefix_cache_hits_total"
    )
    assert queries == 2 * 70
    assert hits == 4 * 16
