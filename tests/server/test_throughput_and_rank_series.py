"""The throughput and rank-skew series against what the requests were: generated tokens per tenant,
per rank bucket and per top-K adapter equal the responses' usage; the rank-skew histograms count
each request and each step in its adapter's rank bucket (native engine)."""

from __future__ import annotations

import pytest
from harness import MODEL
from test_metrics_audit import NO_EOS, _samples, _value

from loraplex.engines.rank_skew import RANK_BUCKETS, rank_bucket

# (tenant, model, max_tokens); run one at a time, so each step's batch holds one request
CALLS = [
    ("alice", "shared-a", 3),  # attn-r8
    ("alice", "shared-a", 4),
    ("bob", "shared-a", 5),
    ("alice", "alice-a", 2),  # mlp-r4
    ("alice", "alice-a", 6),
    ("alice", "wide-a", 7),  # all-r16-rslora
    ("bob", MODEL, 3),  # the base model
    ("alice", MODEL, 4),
]
RANKS = {"shared-a": 8, "alice-a": 4, "wide-a": 16, MODEL: None}


def add_wide(llama_adapters):
    def setup(registry):
        registry.add_revision(
            llama_adapters["all-r16-rslora"], "wide-a", shared=True, status="stable"
        )

    return setup


@pytest.fixture(scope="module")
def served(start, llama_adapters):
    """A server with the top-2 adapters' series on, after CALLS; yields it and each call's
    completion_tokens."""
    with start(top_k_adapter_metrics=2, registry_setup=add_wide(llama_adapters)) as running:
        clients = {t: running.client(t) for t in ("alice", "bob")}
        usage = []
        for tenant, model, max_tokens in CALLS:
            out = clients[tenant].completions.create(
                model=model, prompt="count me", max_tokens=max_tokens, extra_body=NO_EOS
            )
            usage.append(out.usage.completion_tokens)
        yield running, usage


def test_generated_tokens_per_tenant_equal_the_responses_usage(served):
    running, usage = served
    s = _samples(running.url)
    for tenant in ("alice", "bob"):
        expected = sum(u for (t, _, _), u in zip(CALLS, usage) if t == tenant)
        name = "loraplex_tenant_generated_tokens_total"
        assert _value(s, name, tenant=tenant) == expected


def test_generated_tokens_per_rank_bucket_follow_the_adapters_ranks(served):
    running, usage = served
    s = _samples(running.url)
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for (_, model, _), u in zip(CALLS, usage):
        expected[rank_bucket(RANKS[model])] += u
    assert expected["<=16"] and expected["<=8"] and expected["base"]  # three buckets in play
    for bucket, tokens in expected.items():
        name = "loraplex_rank_generated_tokens_total"
        assert _value(s, name, rank_bucket=bucket) == tokens


def test_top_k_adapters_get_requests_and_tokens_the_rest_none(served):
    running, usage = served
    s = _samples(running.url)
    for adapter in ("shared-a", "alice-a"):  # 3 and 2 requests; wide-a's 1 is outside the top 2
        calls = [(c, u) for c, u in zip(CALLS, usage) if c[1] == adapter]
        assert _value(s, "loraplex_adapter_requests_total", adapter=adapter) == len(calls)
        tokens = _value(s, "loraplex_adapter_generated_tokens_total", adapter=adapter)
        assert tokens == sum(u for _, u in calls)
    assert ("loraplex_adapter_generated_tokens_total", (("adapter", "wide-a"),)) not in s


def test_tpot_by_rank_counts_each_request_in_its_adapters_bucket(served):
    running, _ = served
    s = _samples(running.url)
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for _, model, max_tokens in CALLS:
        expected[rank_bucket(RANKS[model])] += max_tokens > 1
    for bucket, n in expected.items():
        name = "loraplex_request_tpot_by_rank_seconds_count"
        assert _value(s, name, rank_bucket=bucket) == n, bucket
        inf = _value(
            s, "loraplex_request_tpot_by_rank_seconds_bucket", rank_bucket=bucket, le="+Inf"
        )
        assert inf == n


def test_step_time_by_rank_counts_every_step_of_each_request(served):
    """One request at a time: a request of max_tokens m runs m steps (its prefill, then m - 1
    decodes), each in its adapter's bucket."""
    running, _ = served
    s = _samples(running.url)
    expected = dict.fromkeys(RANK_BUCKETS, 0)
    for _, model, max_tokens in CALLS:
        expected[rank_bucket(RANKS[model])] += max_tokens
    for bucket, n in expected.items():
        assert _value(s, "loraplex_engine_step_seconds_count", rank_bucket=bucket) == n, bucket
    assert _value(s, "loraplex_engine_step_seconds_sum", rank_bucket="<=16") > 0


def test_engine_alive_is_exported(served):
    running, _ = served
    assert _value(_samples(running.url), "loraplex_engine_alive") == 1


@pytest.mark.parametrize(
    "rank, bucket",
    [(None, "base"), (0, "base"), (1, "<=8"), (8, "<=8"), (9, "<=16"), (16, "<=16"), (17, "<=64")]
    + [(64, "<=64"), (65, ">64"), (256, ">64")],
)
def test_rank_buckets_edges(rank, bucket):
    assert rank_bucket(rank) == bucket


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_single_stream_steps_no_more_than_its_tokens_and_prefill_chunks(start, chunk):
    """The engine in its own process steps only when there is work: one stream of m tokens over a
    prompt in c prefill chunks takes m + c - 1 steps (the last chunk's step makes the first token),
    and none of them finds nothing to run. The adapter is loaded first, by a one-token request."""
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    engine = {"max_num_batched_tokens": chunk} if chunk else {}

    def steps(s) -> tuple[float, float]:
        ran = sum(
            _value(s, "loraplex_engine_step_seconds_count", rank_bucket=b) for b in RANK_BUCKETS
        )
        return ran, _value(s, "loraplex_engine_empty_steps_total")

    with start(engine=engine, engine_core="process") as running:
        client = running.client()
        client.completions.create(model="shared-a", prompt="x", max_tokens=1)
        ran_before, empty_before = steps(_samples(running.url))
        out = client.completions.create(
            model="shared-a", prompt=prompt, max_tokens=24, extra_body=NO_EOS
        )
        ran, empty = steps(_samples(running.url))
    tokens, prompt_tokens = out.usage.completion_tokens, out.usage.prompt_tokens
    chunks = -(-prompt_tokens // chunk) if chunk else 1
    assert tokens == 24 and chunks > (1 if chunk else 0)
    assert ran - ran_before == tokens + chunks - 1
    assert empty - empty_before == 0
