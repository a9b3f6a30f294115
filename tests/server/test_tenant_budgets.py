"""Per-tenant residency budgets on a real server over real sockets: the seed scenario of two tenants
(`online` with 4 hot adapters under steady traffic, `batch` sweeping 20 of its own and shared ones),
with and without a budget of 2 slots for `batch`; budgets reaching the server from the registry; bad
budgets refused with nothing changed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import httpx
import openai
import pytest
from harness import ADMIN_TOKEN, MODEL, Running, serving, variant
from prometheus_client.parser import text_string_to_metric_families
from test_startup_errors import assert_one_line_errors, run_side_by_side

from loraplex.artifacts import ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.registry import Registry
from loraplex.server.app import ServerConfig, create_app

KEYS = {"online": "online-key-0123456789", "batch": "batch-key-01234567890"}
HOT = [f"online-{i}" for i in range(4)]
SHARED = [f"shared-{i}" for i in range(4)]
SWEEP = SHARED + [f"batch-{i:02d}" for i in range(16)]
SLOTS = 6
REQUEST = {"prompt": "abc", "max_tokens": 3, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def adapter_dirs(llama_adapters, tmp_path_factory):
    """24 adapters with distinct bytes: online's 4, the 4 shared, batch's 16."""
    root, src = tmp_path_factory.mktemp("budget-adapters"), llama_adapters["attn-r8"]
    return {name: variant(src, root / name, 1.0 + 0.03 * i) for i, name in enumerate(HOT + SWEEP)}


@contextlib.contextmanager
def budget_server(llama_dir, adapter_dirs, tmp_path_factory, batch_slots: int | None):
    tmp = tmp_path_factory.mktemp("budgets")
    registry = Registry(
        f"sqlite:///{tmp}/registry.db",
        ArtifactStore(tmp / "artifacts"),
        base_model_dir=llama_dir,
        max_lora_rank=16,
    )
    registry.init()
    registry.add_tenant("online")
    registry.add_tenant("batch", max_gpu_slots=batch_slots)
    for name, path in adapter_dirs.items():
        owner = None if name in SHARED else name.partition("-")[0]
        registry.add_revision(path, name, tenant=owner, shared=owner is None, status="stable")
    # lru: the runtime baseline, under which a sweep pushes idle hot adapters out (score, by its
    # frequency term, resists it without budgets)
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=SLOTS,
            max_lora_rank=16,
            kv_cache_memory_bytes=8 * 2**20,
            eviction_policy="lru",
        )
    )
    keys = {hashlib.sha256(k.encode()).hexdigest(): t for t, k in KEYS.items()}
    app = create_app(
        engine,
        registry,
        ServerConfig(
            MODEL, admin_token=ADMIN_TOKEN, audit_log=tmp / "audit.jsonl", registry_watch_s=0.1
        ),
        keys,
    )
    try:
        with serving(app) as url:
            yield Running(url, app.state.server, registry, tmp)
    finally:
        registry.close()


def client(running: Running, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=KEYS[tenant], max_retries=0)


async def tier_of(c: openai.AsyncOpenAI, model: str) -> str:
    raw = await c.completions.with_raw_response.create(model=model, **REQUEST)
    raw.parse()
    return raw.headers["x-loraplex-cache-tier"]


async def seed_scenario(running: Running) -> tuple[list[str], list[str]]:
    """Online warms its 4 hot adapters (after one request to each shared adapter, which then last
    counted for online), then keeps them busy one request at a time while batch sweeps its 20
    adapters, 6 at a time. Returns the tiers online's requests reported during the sweep, and
    batch's."""
    online, batch = client(running, "online"), client(running, "batch")
    for model in SHARED + HOT + HOT:
        await tier_of(online, model)
    done = asyncio.Event()
    online_tiers: list[str] = []

    async def steady():
        while not done.is_set():
            for model in HOT:
                online_tiers.append(await tier_of(online, model))

    async def sweep():
        gate = asyncio.Semaphore(6)

        async def one(model):
            async with gate:
                return await tier_of(batch, model)

        try:
            return await asyncio.gather(*(one(m) for m in SWEEP))
        finally:
            done.set()

    traffic = asyncio.create_task(steady())
    batch_tiers = await sweep()
    await traffic
    return online_tiers, batch_tiers


def samples(url: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(s: dict, name: str, **labels) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_batch_tenant_at_its_budget_leaves_the_hot_adapters_in_their_slots(
    llama_dir, adapter_dirs, tmp_path_factory
):
    with budget_server(llama_dir, adapter_dirs, tmp_path_factory, batch_slots=2) as running:
        online_tiers, batch_tiers = asyncio.run(seed_scenario(running))
        # never pushed out of a slot
        assert online_tiers and set(online_tiers) == {"gpu"}, online_tiers
        assert len(batch_tiers) == len(SWEEP)  # every batch request completed (200)
        s = samples(running.url)
        assert value(s, "loraplex_tenant_resident_count", tenant="batch", tier="gpu") == 2
        assert value(s, "loraplex_tenant_resident_count", tenant="online", tier="gpu") == 4
        assert value(s, "loraplex_tenant_budget_waits_total", tenant="batch") > 0
        assert value(s, "loraplex_tenant_budget_waits_total", tenant="online") == 0
        nbytes = {a["name"]: a["bytes"] for a in running.state()["adapters"]}
        batch_in_slots = [
            a["name"]
            for a in running.state()["adapters"]
            if a["tier"] == "gpu" and a["charged_to"] == ["batch"]
        ]
        assert value(s, "loraplex_tenant_resident_bytes", tenant="batch", tier="gpu") == sum(
            nbytes[n] for n in batch_in_slots
        )
        tenants = running.state()["tenants"]
        assert tenants["batch"]["gpu"]["slots"] == 2 and tenants["batch"]["gpu"]["max_slots"] == 2
        assert tenants["online"]["gpu"] == {
            "slots": 4,
            "max_slots": None,
            "bytes": sum(nbytes[n] for n in HOT),
        }
        # Each host copy counts for the tenant that used it last: the shared ones for batch.
        assert tenants["batch"]["cpu"]["count"] == len(SWEEP)
        assert tenants["batch"]["cpu"]["bytes"] == sum(nbytes[n] for n in SWEEP)


def test_without_budgets_the_sweep_pushes_the_hot_adapters_out(
    llama_dir, adapter_dirs, tmp_path_factory
):
    with budget_server(llama_dir, adapter_dirs, tmp_path_factory, batch_slots=None) as running:
        online_tiers, batch_tiers = asyncio.run(seed_scenario(running))
        assert len(batch_tiers) == len(SWEEP)
        # some found their adapter pushed out to host memory
        assert set(online_tiers) - {"gpu"}, online_tiers
        assert (
            value(samples(running.url), "loraplex_tenant_budget_waits_total", tenant="batch") == 0
        )


def test_budgets_reach_the_server_from_the_registry_and_bad_ones_change_nothing(
    llama_dir, adapter_dirs, tmp_path_factory
):
    with budget_server(llama_dir, adapter_dirs, tmp_path_factory, batch_slots=None) as running:
        cache = running.server.engine.adapters
        assert cache.budgets.limit("batch", "gpu") is None
        # as `tenant set` elsewhere
        running.registry.set_budget("batch", max_gpu_slots=3, max_cpu_bytes=2**20)
        running.wait_for(
            lambda: (
                running.state()["tenants"].get("batch", {}).get("gpu", {}).get("max_slots") == 3
            ),
            what="the watcher to apply the registry's budget",
        )
        assert running.state()["tenants"]["batch"]["cpu"]["max_bytes"] == 2**20

        before = (running.registry.list_tenants(), cache.budgets)
        for body, field in (
            ({"max_gpu_slots": -1}, "max_gpu_slots"),
            ({"max_gpu_slots": SLOTS + 1}, "max_gpu_slots"),
            ({"max_cpu_bytes": "lots"}, "max_cpu_bytes"),
            ({"max_cpu_bytes": "-5MiB"}, "max_cpu_bytes"),
            ({"max_cpu_bytes": "1TiB"}, "max_cpu_bytes"),
            ({"max_gpu_slots": "two"}, "max_gpu_slots"),
            ({"max_gpu_slots": 1, "max_cpu_bytes": -1}, "max_cpu_bytes"),
        ):
            response = running.admin("PUT", "/admin/tenants/batch/budget", json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == field and field in error["message"], (body, error)
        assert (running.registry.list_tenants(), cache.budgets) == before

        response = running.admin(
            "PUT",
            "/admin/tenants/batch/budget",
            json={"max_cpu_bytes": "1MiB", "max_gpu_slots": None},
        )
        assert response.status_code == 200, response.text
        assert (
            response.json()["gpu"]["max_slots"] is None
            and response.json()["cpu"]["max_bytes"] == 2**20
        )
        record = next(t for t in running.registry.list_tenants() if t.name == "batch")
        assert (record.max_gpu_slots, record.max_cpu_bytes) == (None, 2**20)
        audit = [
            e.detail
            for e in running.registry.audit_events(target="batch")
            if e.action == "tenant_budget"
        ]
        # newest first
        assert audit[:2] == [
            {"max_gpu_slots": None},
            {"max_gpu_slots": 3, "max_cpu_bytes": 2**20},
        ]


def test_bad_default_shares_stop_serve_with_one_line(llama_dir, tmp_path):
    def serve(name: str, *args) -> list:
        return [
            "loraplex.server.cli",
            "--model",
            llama_dir,
            "--port",
            "0",
            "--device",
            "cpu",
            "--data-dir",
            tmp_path / name,
            *args,
        ]

    results = run_side_by_side(
        {
            "gpu share": serve("s1", "--tenant-gpu-share", "1.5"),
            "cpu share": serve("s2", "--tenant-cpu-share", "-0.1"),
        }
    )
    assert_one_line_errors(
        results,
        {"gpu share": ("--tenant-gpu-share", "1.5"), "cpu share": ("--tenant-cpu-share", "-0.1")},
    )
