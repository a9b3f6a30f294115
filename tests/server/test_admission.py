"""Admission control: a bounded waiting queue and per-tenant concurrency (429 + Retry-After), body
limit."""

import threading

import httpx
import openai
import pytest
from harness import KEYS, MODEL

# room for a stream that outlives the test steps
LONG = {
    "max_model_len": 4096,
    "kv_cache_memory_bytes": 16 * 2**20,
}


def _open_stream(running, tenant: str, model: str):
    """A long streaming completion, open, with its first chunk read (so it is surely in flight)."""
    stream = running.client(tenant).completions.create(
        model=model, prompt="x", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    return stream


def test_per_tenant_concurrency_limit_answers_429_with_retry_after(start):
    with start(max_requests_per_tenant=1, engine=LONG) as running:
        stream = _open_stream(running, "alice", MODEL)
        with pytest.raises(openai.RateLimitError) as refused:
            running.client("alice").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert refused.value.response.headers["retry-after"].isdigit()
        assert refused.value.body["code"] == "tenant_quota_exceeded"
        assert running.client("bob").completions.create(model=MODEL, prompt="x", max_tokens=1).usage
        stream.close()
        running.wait_for(
            lambda: running.state()["load"]["in_flight"] == 0, what="the stream to end"
        )
        assert (
            running.client("alice").completions.create(model=MODEL, prompt="x", max_tokens=1).usage
        )
        assert _metric_line(running, 'loraplex_tenant_denied_total{tenant="alice"} 1.0')


def test_full_waiting_queue_answers_429_and_the_waiting_request_still_completes(start):
    with start(max_waiting=1, engine={"max_loras": 1, **LONG}) as running:
        holder = _open_stream(running, "alice", "shared-a")  # holds the only slot
        waiting: dict = {}

        def wait_for_slot():
            waiting["result"] = running.client("alice").completions.create(
                model="alice-a", prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
            )

        thread = threading.Thread(target=wait_for_slot)
        thread.start()
        running.wait_for(
            lambda: running.state()["load"]["admitted_waiting"] == 1, what="a waiting request"
        )
        with pytest.raises(openai.RateLimitError) as refused:
            running.client("bob").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert refused.value.body["code"] == "server_overloaded"
        assert refused.value.response.headers["retry-after"].isdigit()
        holder.close()  # frees the slot: the waiting request goes on
        thread.join(60)
        assert waiting["result"].usage.completion_tokens == 2


def test_body_larger_than_the_limit_is_413_and_serving_goes_on(start):
    with start(max_body_bytes=4096) as running:
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        big = {"model": MODEL, "prompt": "x" * 10_000}
        response = httpx.post(f"{running.url}/v1/completions", json=big, headers=headers)
        assert (
            response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        )

        def chunks():  # no content-length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 1000

        chunked = httpx.post(f"{running.url}/v1/completions", content=chunks(), headers=headers)
        assert chunked.status_code == 413
        ok = httpx.post(
            f"{running.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers=headers,
        )
        assert ok.status_code == 200


def test_max_prompt_tokens_is_named_in_the_error(start):
    with start(max_prompt_tokens=8) as running:
        with pytest.raises(openai.BadRequestError) as refused:
            running.client().completions.create(
                model=MODEL, prompt="hello world " * 10, max_tokens=1
            )
        assert "8" in refused.value.message and "max_prompt_tokens" in refused.value.message
        assert refused.value.body["param"] == "prompt"


def _metric_line(running, line: str) -> bool:
    return line in httpx.get(f"{running.url}/metrics").text
