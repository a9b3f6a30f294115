"""Prefix-aware routing over real processes: two `loraplex serve` workers (native engine) that
both hold both adapters in slots, one SQLite registry, a real `loraplex router`. Requests that
share a system prompt under one adapter follow it to one worker, and the workers' own
prefix-cache series show the hits."""

import functools
import random

import httpx
import pytest

from loraplex.loadgen.procs import (
    prefix_cache,
    start_router,
    start_together,
    start_worker,
    stop_together,
)
from loraplex.registry import Registry

ADMIN = {"Authorization": "Bearer e2e-admin-token-0123456789"}
WORDS = "the quick brown fox jumps over lazy dog hello world adapters and slots".split()


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(40))[:160]


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-e2e")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=llama_dir)
    registry.init()
    names = ["attn-r8", "mlp-r4"]
    for name in names:
        registry.add_revision(llama_adapters[name], name, "r1", status="stable", shared=True)
    registry.close()
    extra = ("--registry", url, "--max-loras", "2")
    workers = start_together(
        [functools.partial(start_worker, llama_dir, root / f"w{i}", {}, *extra) for i in range(2)]
    )
    router = start_router([w.url for w in workers], root / "router", "affinity", "--registry", url)
    try:
        yield router, [w.url for w in workers], names
    finally:
        router.stop()
        stop_together(workers)


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def router_sees_both_everywhere(router_url: str, names: list[str]) -> bool:
    listed = httpx.get(f"{router_url}/admin/workers", headers=ADMIN, timeout=30).json()
    return all(set(names) <= set(w["gpu"]) for w in listed["workers"])


def test_a_shared_prompt_follows_its_prefix_and_the_workers_count_the_hits(fleet):
    router, workers, names = fleet
    for url in workers:  # both adapters in both workers' slots: affinity ties everywhere
        for name in names:
            assert complete(url, name, "hi").status_code == 200
    deadline_polls = 0
    while not router_sees_both_everywhere(router.url, names) and deadline_polls < 300:
        deadline_polls += 1
        httpx.get(f"{router.url}/health", timeout=30)
    assert router_sees_both_everywhere(router.url, names)
    before = [prefix_cache(url) for url in workers]
    prompts = [(names[i % 2], system_prompt(i)) for i in range(4)]
    landed: dict[tuple[str, str], set[str]] = {p: set() for p in prompts}
    for round_ in range(4):
        for model, system in prompts:
            answer = complete(router.url, model, f"{system} question {round_}")
            assert answer.status_code == 200, answer.text
            landed[(model, system)].add(answer.headers["x-loraplex-worker"])
    assert all(len(urls) == 1 for urls in landed.values()), landed
    after = [prefix_cache(url) for url in workers]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    # every request after a prompt's first finds its system prompt: 3 of 4, ~150 of ~170 tokens
    assert queries > 0 and hits / queries >= 0.5, (hits, queries)
    used = {url for urls in landed.values() for url in urls}
    for url, a, b in zip(workers, after, before):
        assert (a[1] > b[1]) == (url in used)
