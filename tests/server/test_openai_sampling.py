"""vLLM's sampling parameters over HTTP: n, best_of, min_p, echo and response_format, through the
openai client."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harness import MODEL

NO_EOS = {"ignore_eos": True}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


def test_n_choices_per_prompt_numbered_as_vllm_with_usage_counting_each_prompt_once(running):
    client = running.client()
    args = dict(model="shared-a", max_tokens=5, temperature=0, extra_body=NO_EOS)
    alone = [client.completions.create(prompt=p, **args) for p in ("hello world", "the lazy dog")]
    both = client.completions.create(prompt=["hello world", "the lazy dog"], n=3, **args)
    assert [c.index for c in both.choices] == list(range(6))
    for i, choice in enumerate(both.choices):
        # greedy: every choice of a prompt is its one greedy answer
        assert choice.text == alone[i // 3].choices[0].text
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 6 * 5


def test_n_sampled_choices_differ_and_stream_as_they_come_out_plain(running):
    client = running.client()
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=1.0,
        seed=4,
        n=3,
        extra_body=NO_EOS,
    )
    plain = client.chat.completions.create(**args)
    texts = [c.message.content for c in plain.choices]
    assert len(set(texts)) > 1  # seeds seed, seed + 1, seed + 2: distinct draws
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


def test_best_of_returns_the_choice_of_highest_cumulative_logprob(running):
    client = running.client()
    args = dict(
        model="shared-a",
        prompt="hello world",
        max_tokens=6,
        temperature=1.0,
        seed=9,
        logprobs=0,
        extra_body=NO_EOS,
    )
    every = client.completions.create(n=4, **args)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(
        n=1,
        extra_body={**NO_EOS, "best_of": 4},
        **{k: v for k, v in args.items() if k != "extra_body"},
    )
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == every.choices[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 6


def test_min_p_of_one_is_greedy(running):
    client = running.client()
    args = dict(model="shared-a", prompt="the quick brown", max_tokens=8, extra_body=NO_EOS)
    greedy = client.completions.create(temperature=0, **args).choices[0].text
    sampled = client.completions.create(
        temperature=1.0, seed=1, **{**args, "extra_body": {**NO_EOS, "min_p": 1}}
    )
    assert sampled.choices[0].text == greedy


def test_echo_puts_the_prompt_and_its_logprobs_first(running):
    client = running.client()
    args = dict(
        model="shared-a", prompt="hello world", max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    plain = client.completions.create(**args)
    echoed = client.completions.create(echo=True, logprobs=1, **args)
    choice = echoed.choices[0]
    assert choice.text == "hello world" + plain.choices[0].text
    lp = choice.logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 4
    # the first prompt token has none
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[num_prompt:]) == plain.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(echo=True, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[0].choices[0].text.startswith("hello world")
    # the prompt only
    alone = client.completions.create(echo=True, logprobs=1, **{**args, "max_tokens": 0})
    assert alone.choices[0].text == "hello world"
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:num_prompt]


def test_chat_echo_puts_the_last_assistant_message_first(running):
    client = running.client()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    args = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=NO_EOS)
    plain = client.chat.completions.create(**args).choices[0].message.content
    echoed = client.chat.completions.create(**{**args, "extra_body": {**NO_EOS, "echo": True}})
    assert echoed.choices[0].message.content == "Once upon" + plain
    user_last = client.chat.completions.create(
        **{**args, "messages": messages[:1], "extra_body": {**NO_EOS, "echo": True}}
    )
    assert (
        user_last.choices[0].message.content
        == client.chat.completions.create(**{**args, "messages": messages[:1]})
        .choices[0]
        .message.content
    )


def _grammar_accepts(running, spec, text: str) -> bool:
    return running.server.engine.grammars.matcher(spec).accept_string(text)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_json_schema_is_followed_beside_plain_requests(running, endpoint):
    from loraplex.engines.native.sequence import StructuredOutput

    client = running.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}

    def structured():
        if endpoint == "chat":
            r = client.chat.completions.create(
                model="shared-a",
                messages=[{"role": "user", "content": "a city"}],
                max_tokens=40,
                temperature=0.7,
                seed=3,
                response_format=fmt,
                n=2,
            )
            return [(c.message.content, c.finish_reason) for c in r.choices]
        r = client.completions.create(
            model="shared-a",
            prompt="a city",
            max_tokens=40,
            temperature=0.7,
            seed=3,
            n=2,
            extra_body={"response_format": fmt},
        )
        return [(c.text, c.finish_reason) for c in r.choices]

    def plain():
        return (
            client.completions.create(
                model=MODEL, prompt="the lazy dog", max_tokens=10, temperature=0, extra_body=NO_EOS
            )
            .choices[0]
            .text
        )

    alone = plain()
    with ThreadPoolExecutor(4) as pool:  # structured and plain requests share the running batch
        futures = [pool.submit(structured), pool.submit(plain), pool.submit(plain)]
        results = [f.result() for f in futures]
    assert results[1] == results[2] == alone
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    for text, reason in results[0]:
        assert _grammar_accepts(running, spec, text), text
        if reason == "stop":
            value = json.loads(text)
            assert set(value) == {"city", "n"} and isinstance(value["n"], int)


def test_json_object_output_is_json_when_it_ends(running):
    from loraplex.engines.native.sequence import StructuredOutput

    r = running.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert _grammar_accepts(running, StructuredOutput(json_object=True), text), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_refused_schema_and_oversized_n_are_400s_and_other_requests_go_on(start):
    per_token = 2 * 2 * 2 * 16 * 4  # the tiny model's K and V bytes per token, float32
    with start(
        engine=dict(block_size=4, max_model_len=32, kv_cache_memory_bytes=64 * per_token)
    ) as small:
        headers = {"Authorization": "Bearer alice-key-0123456789"}
        url = f"{small.url}/v1/completions"
        base = {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 4}
        bad_schema = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "wizard"}},
        }
        with ThreadPoolExecutor(3) as pool:
            ok = pool.submit(
                httpx.post,
                url,
                json={**base, "ignore_eos": True, "temperature": 0},
                headers=headers,
                timeout=60,
            )
            refused = pool.submit(
                httpx.post,
                url,
                json={**base, "response_format": bad_schema},
                headers=headers,
                timeout=60,
            )
            too_many = pool.submit(
                httpx.post, url, json={**base, "n": 15}, headers=headers, timeout=60
            )
            results = ok.result(), refused.result(), too_many.result()
        assert (
            results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 4
        )
        assert (
            results[1].status_code == 400
            and results[1].json()["error"]["param"] == "response_format"
        )
        assert results[2].status_code == 400 and results[2].json()["error"]["param"] == "n"
        assert "KV" in results[2].json()["error"]["message"]
        fits = httpx.post(url, json={**base, "n": 14}, headers=headers, timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 14
