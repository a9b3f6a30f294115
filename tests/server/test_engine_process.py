"""The native engine in its own process (`--engine-core process`): real uvicorn, a real engine
process over Unix sockets, the same answers as the engine on a thread, and a dead engine process
ending its requests with 503."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from test_startup_errors import assert_one_line_errors, run_side_by_side

PROMPTS = ["the quick brown fox", "hello world, adapters", "jumps over the lazy dog"]
MODELS = ["tiny", "shared-a", "alice-a"]


@pytest.fixture(scope="module")
def process(start):
    with start(engine_core="process") as r:
        yield r


@pytest.fixture(scope="module")
def thread(start):
    with start(engine_core="thread") as r:
        yield r


def _complete(running, model: str, prompt: str, **kwargs) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kwargs}
    response = httpx.post(
        f"{running.url}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer alice-key-0123456789"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_the_engine_runs_in_another_process(process):
    pid = process.server.engine.process.pid
    assert pid != os.getpid()
    assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # a child of this process, running


def test_greedy_outputs_equal_the_thread_modes(process, thread):
    for model in MODELS:
        for prompt in PROMPTS:
            ours = _complete(process, model, prompt, logprobs=2)["choices"][0]
            theirs = _complete(thread, model, prompt, logprobs=2)["choices"][0]
            assert ours["text"] == theirs["text"]
            assert ours["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
            assert ours["logprobs"]["token_logprobs"] == pytest.approx(
                theirs["logprobs"]["token_logprobs"], abs=1e-5
            )


def test_batched_requests_equal_the_thread_modes(process, thread):
    """Several requests at once, in one running batch on each side."""

    def batch(running):
        out = [None] * len(MODELS)

        def one(i):
            out[i] = _complete(running, MODELS[i], PROMPTS[i], max_tokens=16)["choices"][0]["text"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(MODELS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    assert batch(process) == batch(thread)


def test_streaming_gives_the_same_text(process):
    plain = _complete(process, "shared-a", PROMPTS[0])["choices"][0]["text"]
    client = process.client()
    chunks = list(
        client.completions.create(
            model="shared-a", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_client_disconnect_aborts_in_the_engine(process):
    headers = {"Authorization": "Bearer alice-key-0123456789"}
    body = {
        "model": "shared-a",
        "prompt": PROMPTS[1],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{process.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # generation has started; then the client leaves
    process.wait_for(
        lambda: process.state()["load"]["running"] == 0 and process.state()["load"]["waiting"] == 0,
        what="the engine process to drop the request",
    )
    assert process.state()["load"]["in_flight"] == 0


def test_admin_pin_and_evict_reach_the_engine(process):
    pinned = process.admin("POST", "/admin/adapters/alice-a/pin", json={"tier": "gpu"})
    assert pinned.status_code == 200, pinned.text
    row = next(a for a in process.state()["adapters"] if a["name"] == "alice-a")
    assert (row["pinned"], row["tier"]) == ("gpu", "gpu")
    # what the server reads per request without asking the engine follows too
    target = process.server.resolver.resolve("alice", "alice-a", None)
    assert process.server.tier_on_arrival(target) == "gpu"
    evicted = process.admin("POST", "/admin/adapters/alice-a/evict")
    assert evicted.status_code == 200, evicted.text
    row = next(a for a in process.state()["adapters"] if a["name"] == "alice-a")
    assert row["pinned"] is None and row["tier"] != "gpu"
    target = process.server.resolver.resolve("alice", "alice-a", None)
    assert process.server.tier_on_arrival(target) != "gpu"


def test_a_cpu_pin_answers_once_the_engine_process_took_the_load_in(process):
    evicted = process.admin("POST", "/admin/adapters/shared-a/evict")
    assert evicted.status_code == 200, evicted.text
    pinned = process.admin("POST", "/admin/adapters/shared-a/pin", json={"tier": "cpu"})
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["loading"] == []
    row = next(a for a in process.state()["adapters"] if a["name"] == "shared-a")
    assert row["pinned"] == "cpu" and row["tier"] in ("cpu", "gpu")
    assert process.admin("POST", "/admin/adapters/shared-a/unpin").status_code == 200


def test_an_unload_after_an_aborted_stream_waits_for_the_engine_process(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(engine_core="process", allowed_roots=roots, engine={"max_model_len": 1024}) as r:
        load = {"lora_name": "dyn", "lora_path": str(adapter_variants[1])}
        assert r.admin("POST", "/v1/load_lora_adapter", json=load).status_code == 200
        stream = r.client().completions.create(
            model="dyn", prompt="x", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        stream.close()  # the engine process gives the slot back on its next step
        unloaded = r.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn"})
        assert unloaded.status_code == 200, unloaded.text
        assert not [a for a in r.state()["adapters"] if a["name"] == "dyn"]


def test_an_engine_error_crosses_as_its_http_answer(process):
    """CapacityExceeded raised in the engine process is the 409 the thread mode gives."""
    names = ["shared-a", "alice-a"]  # two gpu pins, two slots: one must stay free
    answers = [
        process.admin("POST", f"/admin/adapters/{n}/pin", json={"tier": "gpu"}) for n in names
    ]
    try:
        assert [a.status_code for a in answers] == [200, 409]
        assert answers[1].json()["error"]["code"] == "capacity_exceeded"
        rows = {a["name"]: a["pinned"] for a in process.state()["adapters"]}
        assert rows["shared-a"] == "gpu" and rows.get("alice-a") is None
    finally:
        for n in names:
            process.admin("POST", f"/admin/adapters/{n}/unpin")


def test_a_dead_engine_process_ends_requests_with_503(start):
    with start(engine_core="process") as running:
        before = [a.to_dict() for a in running.registry.list_adapters()]
        _complete(running, "shared-a", PROMPTS[0])  # warm: the adapter is in a slot
        pid = running.server.engine.process.pid
        os.kill(pid, signal.SIGSTOP)  # the request below is surely in flight when the kill comes
        answer = {}

        def request():
            body = {"model": "shared-a", "prompt": PROMPTS[2], "max_tokens": 50}
            answer["r"] = httpx.post(
                f"{running.url}/v1/completions",
                json=body,
                headers={"Authorization": "Bearer alice-key-0123456789"},
                timeout=60,
            )

        t = threading.Thread(target=request)
        t.start()
        running.wait_for(
            lambda: running.server.admission.num_in_flight == 1, what="the request in flight"
        )
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        response = answer["r"]
        assert response.status_code == 503
        error = response.json()["error"]
        assert (
            error["code"] == "engine_unavailable" and error["type"] == "service_unavailable_error"
        )
        health = httpx.get(f"{running.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_unavailable"
        again = httpx.post(
            f"{running.url}/v1/completions",
            json={"model": "shared-a", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": "Bearer alice-key-0123456789"},
            timeout=10,
        )
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
        assert [a.to_dict() for a in running.registry.list_adapters()] == before


def test_bad_input_at_start_is_one_line_in_process_mode(llama_dir, tmp_path):
    """An error the engine process meets while it starts is the line the thread mode prints."""

    def serve(name: str, *args) -> list:
        return ["loraplex.server.cli", "--model", llama_dir, "--port", "0", "--device", "cpu"] + [
            "--data-dir",
            tmp_path / name,
            *args,
        ]

    commands = {
        "bogus core": serve("d1", "--engine-core", "bogus"),
        "vllm in a process": serve("d2", "--engine", "vllm", "--engine-core", "process"),
        "kv budget too small": serve(
            "d3", "--engine-core", "process", "--kv-cache-memory-bytes", "64KiB"
        ),
    }
    expected = {
        "bogus core": ("--engine-core bogus", "use process | thread"),
        "vllm in a process": ("--engine-core process", "--engine native"),
        "kv budget too small": ("--kv-cache-memory-bytes 64KiB", "--max-model-len"),
    }
    assert_one_line_errors(run_side_by_side(commands), expected)


def test_serve_runs_the_engine_in_a_process_of_its_own_by_default(llama_dir, tmp_path):
    import psutil
    from test_serve_cli import _address, _serve

    args = ["--model", llama_dir, "--port", "0", "--data-dir", tmp_path / "data"]
    proc = _serve([*args, "--dtype", "float32", "--kv-cache-memory-bytes", "8MiB"], tmp_path)
    try:
        url = _address(proc)
        body = {"model": llama_dir.name, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        engines = [
            child
            for child in psutil.Process(proc.pid).children()
            if "spawn_main" in " ".join(child.cmdline())
        ]
        assert len(engines) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not engines[0].is_running() or engines[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
