"""The OpenAI API through the official `openai` client: plain, streamed and chat calls, headers,
refusals."""

import json

import httpx
import openai
import pytest
from harness import KEYS, MODEL
from sqlalchemy import text

NO_EOS = {"ignore_eos": True}  # vLLM extras go in extra_body with the official client


def test_completion_for_base_and_adapter_with_usage_and_headers(running):
    client = running.client()
    for model in (MODEL, "shared-a", "alice-a"):
        raw = client.completions.with_raw_response.create(
            model=model, prompt="hello world", max_tokens=4, temperature=0
        )
        completion = raw.parse()
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.prompt_tokens > 0 and 1 <= completion.usage.completion_tokens <= 4
        assert (
            completion.usage.total_tokens
            == completion.usage.prompt_tokens + completion.usage.completion_tokens
        )
        assert raw.headers["x-request-id"]
        assert raw.headers["x-loraplex-cache-tier"] in ("gpu", "cpu", "disk", "remote")
        assert raw.headers["x-loraplex-adapter-digest"].startswith("sha256:")
        expected = MODEL if model == MODEL else f"{model}@r1"
        assert raw.headers["x-loraplex-adapter"] == expected


def test_adapter_changes_the_answer_and_greedy_is_repeatable(running):
    client = running.client()

    def ask(model):
        return (
            client.completions.create(
                model=model,
                prompt="the quick brown",
                max_tokens=8,
                temperature=0,
                extra_body=NO_EOS,
            )
            .choices[0]
            .text
        )

    base, adapted = ask(MODEL), ask("shared-a")
    assert base != adapted
    assert ask("shared-a") == adapted
    assert ask("shared-a@r1") == adapted


def test_streamed_completion_matches_the_plain_one(running):
    client = running.client()
    args = dict(
        model="shared-a", prompt="hello world", max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6  # usage on the final chunk


def test_stream_options_include_usage_adds_a_usage_chunk(running):
    stream = running.client().chat.completions.create(
        model="shared-a",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_body=NO_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat_plain_and_streamed_agree(running):
    client = running.client()
    args = dict(
        model="alice-a",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ],
        max_tokens=6,
        temperature=0,
        extra_body=NO_EOS,
    )
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].message.role == "assistant"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **args)
        if c.choices
    )
    assert streamed == plain.choices[0].message.content
    assert plain.usage.completion_tokens == 6


def test_logprobs_in_both_shapes(running):
    client = running.client()
    completion = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_logprobs_name_the_sampled_token_and_special_tokens_as_vllm(running):
    """Completions' top_logprobs hold the sampled token besides the top k (so logprobs=0 names it),
    and a special token such as EOS is named by its text (it was "": a client could not see why the
    output stopped)."""
    client = running.client()
    for k in (0, 1):
        completion = client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=8,
            temperature=2.0,
            seed=7,
            logprobs=k,
            extra_body=NO_EOS,
        )
        lp = completion.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == logprob and len(top) <= k + 1
    eos = running.server.engine.tokenizer.eos_token
    eos_id = running.server.engine.tokenizer.eos_token_id
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        logit_bias={str(eos_id): 100},
    )
    assert chat.choices[0].finish_reason == "stop"
    last = chat.choices[0].logprobs.content[-1]
    assert eos and last.token == eos and last.bytes == list(eos.encode())


def test_prompt_as_token_ids_and_as_a_list_of_strings(running):
    client = running.client()
    by_ids = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=2, extra_body=NO_EOS
    )
    assert by_ids.usage.prompt_tokens == 3
    several = client.completions.create(
        model=MODEL, prompt=["one", "two words"], max_tokens=2, extra_body=NO_EOS
    )
    assert [c.index for c in several.choices] == [0, 1]
    assert several.usage.completion_tokens == 4
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=["a", "b"], max_tokens=3, extra_body=NO_EOS, stream=True
        )
    )
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
    # once, on the last chunk
    assert [c.usage.completion_tokens for c in streamed if c.usage] == [6]


def test_stop_strings_seed_and_vllm_extras(running):
    client = running.client()
    args = dict(
        model="shared-a",
        prompt="the lazy dog",
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"top_k": 20},
    )
    assert (
        client.completions.create(**args).choices[0].text
        == client.completions.create(**args).choices[0].text
    )
    ended = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=12,
        extra_body={"min_tokens": 12, "ignore_eos": False, "repetition_penalty": 1.2},
    )
    assert ended.usage.completion_tokens == 12


def test_client_defaults_such_as_langchains_are_accepted(running):
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 2,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": {},
        "n": 1,
        "best_of": 1,
        "echo": False,
        "top_p": 1,
        "stream": False,
        "user": "u1",
    }
    assert (
        httpx.post(f"{running.url}/v1/completions", json=body, headers=_auth()).status_code == 200
    )
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 2,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
    }
    assert (
        httpx.post(f"{running.url}/v1/chat/completions", json=chat, headers=_auth()).status_code
        == 200
    )


def _auth(tenant_key: str = "alice-key-0123456789") -> dict:
    return {"Authorization": f"Bearer {tenant_key}"}


BAD_REQUESTS = [
    (b"{not json", None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -3}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": 12.5}', "prompt"),
    (b'{"model": "tiny", "prompt": "x", "temperature": 9}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "frobnicate": true}', "frobnicate"),
    (b'{"model": "tiny", "prompt": "x", "n": 0}', "n"),
    (b'{"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}', "best_of"),
    (b'{"model": "tiny", "prompt": "x", "best_of": 2, "stream": true}', "best_of"),
    (b'{"model": "tiny", "prompt": "x", "min_p": 1.5}', "min_p"),
    (b'{"model": "tiny", "prompt": "x", "response_format": {"type": "yaml"}}', "response_format"),
    (
        b'{"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}',
        "response_format",
    ),
    (b'{"model": "tiny", "prompt": "x", "suffix": "y"}', "suffix"),
    (b'{"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}', "logit_bias"),
    # "²".isdigit()
    (
        '{"model": "tiny", "prompt": "x", "logit_bias": {"\u00b2": 1}}'.encode(),
        "logit_bias",
    ),
    # Arabic-Indic 3
    (
        '{"model": "tiny", "prompt": "x", "logit_bias": {"\u0663": 1}}'.encode(),
        "logit_bias",
    ),
    (b'{"model": "tiny", "prompt": []}', "prompt"),
    (b'{"model": "tiny", "prompt": [1, 2, 99999]}', "prompt"),
    (b'{"prompt": "x"}', "model"),
    (b"[1, 2]", None),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_requests_get_400_in_the_openai_shape(running, body, param):
    response = httpx.post(f"{running.url}/v1/completions", content=body, headers=_auth())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    assert error["param"] == param
    assert response.headers["x-request-id"]


CHAT_REFUSALS = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "wizard"}},
            }
        },
        "response_format",
    ),
    ({"n": 65}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages",
    ),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"seed": 2**64}, "seed"),
]


@pytest.mark.parametrize("extra,param", CHAT_REFUSALS)
def test_unsupported_chat_fields_are_refused_when_not_default(running, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(f"{running.url}/v1/chat/completions", json=body, headers=_auth())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_sdk_raises_its_error_types_and_the_server_keeps_serving(running):
    client = running.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x")
    too_long = "hello world " * 200  # more tokens than max_model_len
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=2)
    assert "max_prompt_tokens" in long_prompt.value.message
    still = client.completions.create(
        model=MODEL, prompt="still here", max_tokens=2, extra_body=NO_EOS
    )
    assert still.usage.completion_tokens == 2


def test_cache_tier_header_goes_disk_then_gpu(start):
    with start(engine={"max_loras": 4}) as running:  # free slots: nothing else decides what stays
        client = running.client("bob")
        tiers = [
            client.completions.with_raw_response.create(
                model="bob-a", prompt="x", max_tokens=1
            ).headers["x-loraplex-cache-tier"]
            for _ in range(3)
        ]
    assert tiers == ["disk", "gpu", "gpu"]


def test_request_id_is_echoed(running):
    response = httpx.post(
        f"{running.url}/v1/completions",
        headers={**_auth(), "x-request-id": "my-id-42"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
    )
    assert response.headers["x-request-id"] == "my-id-42"
    assert response.json()["id"] == "cmpl-my-id-42"


def test_health_ready_and_unknown_paths(running):
    assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{running.url}/ready").status_code == 200
    missing = httpx.get(f"{running.url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()


def test_adapter_that_cannot_load_is_503_and_the_others_keep_serving(start, adapter_variants):
    def register(registry):
        record = registry.add_revision(adapter_variants[3], "broken", shared=True, status="stable")
        weights = registry.store.path(record.digest) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF  # the bytes no longer hash to the digest the registry recorded
        weights.write_bytes(bytes(data))

    with start(registry_setup=register) as running:
        client = running.client()
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="broken", prompt="x", max_tokens=2)
        assert (
            failed.value.status_code == 503 and failed.value.body["code"] == "adapter_unavailable"
        )
        assert "digest" in failed.value.message
        # no server paths
        assert str(running.tmp) not in failed.value.message and "/" not in failed.value.message
        # The revision is quarantined: never served again, and with no other revision the name is
        # gone.
        running.wait_for(
            lambda: running.registry.show("broken").revisions[0].status == "quarantined",
            what="quarantine",
        )
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError):
                result = client.completions.create(
                    model="broken", prompt="x", max_tokens=2, stream=stream
                )
                list(result) if stream else None
        assert (
            client.completions.create(
                model="shared-a", prompt="x", max_tokens=2, extra_body=NO_EOS
            ).usage.completion_tokens
            == 2
        )


def test_loads_check_the_registered_pieces(start, adapter_variants):
    """The served adapters' bytes are checked against the piece list the registry took at
    registration: with one piece hash of that list changed, loading the (intact) bytes fails as a
    digest mismatch."""

    def register(registry):
        record = registry.add_revision(adapter_variants[2], "listed", shared=True, status="stable")
        listed = json.loads(registry.pieces(record.digest).to_json())
        listed["files"][-1][listed["algorithm"]][0] = "0" * 64
        with registry.engine.begin() as conn:
            conn.execute(
                text("UPDATE artifact_pieces_blake3 SET pieces = :p WHERE digest = :d"),
                {"p": json.dumps(listed), "d": record.digest},
            )

    with start(registry_setup=register) as running:
        client = running.client()
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="listed", prompt="x", max_tokens=2)
        assert failed.value.status_code == 503 and "digest" in failed.value.message
        assert (
            client.completions.create(
                model="shared-a", prompt="x", max_tokens=1
            ).usage.completion_tokens
            == 1
        )
        record = running.server.catalog.resolve("alice", "shared-a")
        ref = running.server.resolver.ref_for(record)
        assert ref.pieces is not None and ref.pieces == running.registry.pieces(record.digest)


def test_a_huge_prompt_is_refused_without_tokenizing_it(running):
    response = httpx.post(
        f"{running.url}/v1/completions",
        headers=_auth(),
        json={"model": MODEL, "prompt": "x" * 1_000_000, "max_tokens": 1},
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt_too_long"


def test_openapi_and_docs_publish_the_request_models_as_bodies(running):
    spec = httpx.get(f"{running.url}/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    wanted = {
        "/v1/completions": {"model", "prompt", "max_tokens", "stream", "ignore_eos"},
        "/v1/chat/completions": {"model", "messages", "max_tokens", "stream"},
    }
    for path, fields in wanted.items():
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert fields <= set(body["properties"]) and "model" in body["required"]
        assert "$ref" not in json.dumps(body)  # self-contained: nested models inlined
    message = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "role" in message["schema"]["properties"]["messages"]["items"]["properties"]
    assert "/v1/models" in paths
    docs = httpx.get(f"{running.url}/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text
    assert "swagger" in docs.text.lower()
    # The documented body is documentation only: a bad body still gets the OpenAI error shape
    refused = httpx.post(
        f"{running.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "n": "many"},
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
