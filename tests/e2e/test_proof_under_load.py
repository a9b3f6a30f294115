"""Proof under load on the demo world: every answer is checked against its adapter's known
transform.

Sizes: LORAPLEX_SOAK_REQUESTS (default 2000) scales the soak for a long run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import time

import httpx
import psutil
import pytest
from world_fleet import build_catalog, checked_inputs, pick

from loraplex.demo.world import TRANSFORMS, make_prompt
from loraplex.loadgen.procs import (
    ADMIN_TOKEN,
    start_router,
    start_together,
    start_worker,
    state,
    stop_together,
)

SOAK_REQUESTS = int(os.environ.get("LORAPLEX_SOAK_REQUESTS", "2000"))


async def ask(client, url, key, model, text, stream, chat=False, max_tokens=40):
    """(status, output text, adapter header, worker header, chunks received)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", make_prompt(text)
    out, chunks = "", 0
    async with client.stream(
        "POST", url + path, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        adapter, worker = (
            r.headers.get("x-loraplex-adapter", ""),
            r.headers.get("x-loraplex-worker"),
        )
        if r.status_code != 200 or not stream:
            data = json.loads(await r.aread())
            if r.status_code == 200:
                choice = data["choices"][0]
                out = choice["message"]["content"] if chat else choice["text"]
            return r.status_code, out, adapter, worker, 1
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                choices = json.loads(line[6:])["choices"]
                if choices:
                    out += (
                        choices[0].get("delta", {}).get("content")
                        if chat
                        else choices[0].get("text")
                    ) or ""
    return r.status_code, out, adapter, worker, chunks


def rss_mb(procs) -> float:
    return sum(psutil.Process(p.p.pid).memory_info().rss for p in procs) / 2**20


@pytest.fixture(scope="module")
def good_inputs(demo_world):
    return checked_inputs(demo_world)


@pytest.fixture(scope="module")
def soak_fleet(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    catalog = build_catalog(demo_world, root / "registry")
    workers = start_together(
        [
            functools.partial(
                start_worker,
                demo_world.model_dir,
                root / f"w{i}",
                {},
                "--registry",
                catalog.registry_url,
                "--max-loras",
                "4",
                max_lora_rank=32,
            )
            for i in range(2)
        ]
    )
    router = start_router([w.url for w in workers], root / "router")
    try:
        yield catalog, workers, router
    finally:
        router.stop()
        stop_together(workers)


def test_soak_two_workers_and_a_router_give_no_wrong_or_lost_answer(soak_fleet, good_inputs):
    catalog, workers, router = soak_fleet
    rng = random.Random(0)
    results = {"ok": 0, "wrong": [], "lost": []}

    async def run(n: int):
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i):
                tenant, name = pick(catalog, rng)
                text = rng.choice(good_inputs[catalog.transform_of[name]])
                stream, chat = rng.random() < 0.5, rng.random() < 0.2
                async with gate:
                    try:
                        status, out, adapter, _, _ = await ask(
                            client, router.url, catalog.keys[tenant], name, text, stream, chat
                        )
                    except httpx.HTTPError as exc:
                        results["lost"].append((name, repr(exc)))
                        return
                if status != 200:
                    results["lost"].append((name, status))
                elif out.strip() != TRANSFORMS[catalog.transform_of[name]](
                    text
                ) or not adapter.startswith(name + "@"):
                    results["wrong"].append((name, adapter, text, out))
                else:
                    results["ok"] += 1

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(run(64))  # warm-up: the processes reach their working size
    start_mb = rss_mb(workers)
    started = time.perf_counter()
    asyncio.run(run(SOAK_REQUESTS))
    seconds = time.perf_counter() - started
    assert results["wrong"] == [] and results["lost"] == [], (
        results["wrong"][:5],
        results["lost"][:5],
    )
    assert results["ok"] == SOAK_REQUESTS + 64
    for w in workers:  # every reference released, every KV block back
        deadline = time.monotonic() + 30
        while True:
            s = state(w.url)
            if (
                s["load"]["running"] == 0
                and s["load"]["waiting"] == 0
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.1)
        assert s["load"]["running"] == 0 and s["load"]["waiting"] == 0
        assert all(a["in_flight"] == 0 for a in s["adapters"])
        assert s["load"]["kv_cache_usage"] == 0
    end_mb = rss_mb(workers)
    assert end_mb <= start_mb + 300, (start_mb, end_mb)
    print(
        f"soak: {SOAK_REQUESTS} requests in {seconds:.1f} s, rss {start_mb:.0f} -> {end_mb:.0f} MiB"
    )


def test_version_safety_canary_and_rollback(demo_world, good_inputs, tmp_path):
    from loraplex.registry import Registry

    registry = Registry(
        f"sqlite:///{tmp_path / 'registry.db'}",
        base_model_dir=demo_world.model_dir,
        max_lora_rank=32,
    )
    registry.init()
    registry.add_tenant("acme", 0)
    key = registry.create_key("acme")
    registry.add_revision(
        demo_world.adapters["rot13"], "rot13", revision="r1", shared=True, status="stable"
    )
    # A new revision of `rot13` that is really `reverse`, rolled out at 50%.
    registry.add_revision(demo_world.adapters["reverse"], "rot13", revision="r2", shared=True)
    registry.promote("rot13", "r2", 50, force=True)
    worker = start_worker(
        demo_world.model_dir,
        tmp_path / "w",
        {},
        "--registry",
        registry.url,
        "--max-loras",
        "2",
        max_lora_rank=32,
    )
    expected = {"rot13@r1": TRANSFORMS["rot13"], "rot13@r2": TRANSFORMS["reverse"]}
    inputs = [t for t in good_inputs["rot13"] if t in set(good_inputs["reverse"])] * 4
    assert len(inputs) >= 80
    try:

        async def run(texts):
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(
                    *(
                        ask(client, worker.url, key, "rot13", t, i % 2 == 0)
                        for i, t in enumerate(texts)
                    )
                )

        seen = set()
        for text, (status, out, adapter, _, _) in zip(inputs[:50], asyncio.run(run(inputs[:50]))):
            assert status == 200 and out.strip() == expected[adapter](text), (adapter, text, out)
            seen.add(adapter)
        assert seen == {"rot13@r1", "rot13@r2"}
        r = httpx.post(
            f"{worker.url}/admin/adapters/rot13/rollback",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        for text, (status, out, adapter, _, _) in zip(
            inputs[50:80], asyncio.run(run(inputs[50:80]))
        ):
            assert (status, adapter, out.strip()) == (200, "rot13@r1", TRANSFORMS["rot13"](text))
    finally:
        worker.stop()


def test_killed_worker_fails_only_requests_that_had_started_streaming_on_it(soak_fleet):
    catalog, workers, router = soak_fleet
    victim = workers[1]
    tenant = "acme"
    names = catalog.allowed[tenant][:8]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i):
                try:
                    return await ask(
                        client,
                        router.url,
                        catalog.keys[tenant],
                        names[i % len(names)],
                        "abcdef",
                        True,
                        max_tokens=120,
                    )
                except httpx.HTTPError as exc:
                    return ("error", repr(exc), "", None, 0)

            async def killer():
                await asyncio.sleep(1.0)
                victim.p.send_signal(signal.SIGKILL)

            return await asyncio.gather(*(one(i) for i in range(24)), killer())

    results = asyncio.run(run())[:-1]
    failed = [r for r in results if r[0] != 200 or (r[3] == victim.url and r[4] == 0)]
    for status, _out, _adapter, worker, _chunks in failed:
        assert worker == victim.url or status == "error", (status, worker)
    served_elsewhere = [r for r in results if r[0] == 200 and r[3] != victim.url]
    assert served_elsewhere and len(failed) < len(results)
    # After the kill every new request lands on the survivor.
    after = asyncio.run(_burst(router.url, catalog, tenant, names))
    assert all(status == 200 and worker != victim.url for status, worker in after)


async def _burst(url, catalog, tenant, names):
    async with httpx.AsyncClient(timeout=120) as client:
        out = await asyncio.gather(
            *(ask(client, url, catalog.keys[tenant], n, "abc", False) for n in names)
        )
    return [(r[0], r[3]) for r in out]


def test_release_checks_refuse_a_canary_that_fails_its_eval_set(demo_world, good_inputs, tmp_path):
    """Promotion through the admin API prewarms the revision and runs its eval set on the worker's
    engine."""
    from loraplex.registry import Registry

    registry = Registry(
        f"sqlite:///{tmp_path / 'registry.db'}",
        base_model_dir=demo_world.model_dir,
        max_lora_rank=32,
    )
    registry.init()
    registry.add_revision(
        demo_world.adapters["rot13"], "rot13", revision="r1", shared=True, status="stable"
    )
    cases = "\n".join(
        json.dumps({"prompt": make_prompt(t), "expected": TRANSFORMS["rot13"](t)})
        for t in good_inputs["rot13"][:5]
    )
    (tmp_path / "eval.jsonl").write_text(cases)
    registry.add_revision(
        demo_world.adapters["reverse"],
        "rot13",
        revision="bad",
        shared=True,
        eval_set=tmp_path / "eval.jsonl",
    )
    from world_fleet import variant

    registry.add_revision(
        variant(demo_world.adapters["rot13"], tmp_path / "rot13-r2", "r2"),
        "rot13",
        revision="r2",
        shared=True,
        eval_set=tmp_path / "eval.jsonl",
    )
    worker = start_worker(
        demo_world.model_dir, tmp_path / "w", {}, "--registry", registry.url, max_lora_rank=32
    )
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        refused = httpx.post(
            f"{worker.url}/admin/adapters/rot13/promote",
            json={"revision": "bad", "weight": 10},
            headers=headers,
            timeout=120,
        )
        assert refused.status_code in (409, 422), refused.text
        assert "eval" in refused.json()["error"]["message"]
        assert registry.show("rot13").revisions and all(
            r.traffic_weight == 0 for r in registry.show("rot13").revisions if r.revision == "bad"
        )
        passed = httpx.post(
            f"{worker.url}/admin/adapters/rot13/promote",
            json={"revision": "r2", "weight": 10},
            headers=headers,
            timeout=120,
        )
        assert passed.status_code == 200, passed.text
        weights = {r.revision: r.traffic_weight for r in registry.show("rot13").revisions}
        assert weights["r2"] == 10 and weights["bad"] == 0
    finally:
        worker.stop()
