"""A fleet of two bases behind one router: four real `loraplex serve` workers (native engine), two
on a tiny Llama and two on a tiny Qwen2, one SQLite registry with the adapters of both, and a
real `loraplex router` with a pool per base. Every request reaches a worker of its base, every
answer matches HF+PEFT, and bare-base requests work for both bases."""

import functools
import json
import threading
import time
from collections import Counter

import httpx
import pytest
import yaml
from tinymodels import make_adapter, make_adapters, make_model, peft_reference, reference_greedy
from tokenizers import Tokenizer

from loraplex.loadgen.procs import start_router, start_together, start_worker, stop_together
from loraplex.registry import Registry

BASES = {"llama": "base-llama", "qwen2": "base-qwen"}
PROMPT = [5, 17, 42, 99, 7, 3]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def fleet(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("pools-e2e")
    qwen_dir = make_model(root / "qwen2", "qwen2")
    dirs = {"llama": llama_dir, "qwen2": qwen_dir}
    adapters = {
        "llama": {f"ll-{n}": p for n, p in llama_adapters.items()},
        "qwen2": {f"qw-{n}": p for n, p in make_adapters(qwen_dir, root / "qw").items()},
    }
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url)
    registry.init()
    for kind, named in adapters.items():
        for name, path in named.items():
            registry.add_revision(path, name, "r1", status="stable", base_model_dir=dirs[kind])
    mistral_dir = make_model(root / "mistral", "mistral")
    orphan = make_adapter(mistral_dir, root / "mi-attn", r=8, target_modules=["q_proj"])
    registry.add_revision(orphan, "mi-attn", "r1", status="stable", base_model_dir=mistral_dir)
    wide = make_adapter(llama_dir, root / "ll-r32", r=32, target_modules=["v_proj"])
    registry.add_revision(wide, "ll-r32", "r1", status="stable", base_model_dir=llama_dir)
    starts, kinds = [], []
    for kind, served in BASES.items():
        for i in range(2):
            extra = ("--registry", url, "--served-model-name", served, "--max-loras", "2")
            starts.append(
                functools.partial(start_worker, dirs[kind], root / f"{kind}{i}", {}, *extra)
            )
            kinds.append(kind)
    workers = start_together(starts)
    config = root / "router.yaml"
    pools = [
        {
            "name": f"pool-{kind}",
            "base-model": BASES[kind],
            "max-rank": 16,
            "workers": [w.url for w, k in zip(workers, kinds) if k == kind],
        }
        for kind in BASES
    ]
    config.write_text(yaml.safe_dump({"pool": pools}))
    router = start_router(
        [], root / "router", "affinity", "--config", str(config), "--registry", url
    )
    try:
        wait_for(lambda: _answers(f"{router.url}/health"), "the router to listen")
        yield router, dict(zip((w.url for w in workers), kinds)), dirs, adapters, root
    finally:
        router.stop()
        stop_together(workers)
        registry.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, what: str, timeout: float = 60.0):
    """Until the predicate holds (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def references(dirs, adapters) -> dict[str, list[str]]:
    """Model name -> the tokens HF+PEFT generates greedily for PROMPT, as the server names them."""
    out = {}
    for kind, named in adapters.items():
        model = peft_reference(dirs[kind], named)
        tokenizer = Tokenizer.from_file(str(dirs[kind] / "tokenizer.json"))
        for name in (None, *named):
            ids = reference_greedy(model, PROMPT, name, MAX_TOKENS)
            tokens = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
            out[name or BASES[kind]] = tokens
    return out


def complete(url: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def audit_lines(root, kind: str, i: int) -> list[dict]:
    path = root / f"{kind}{i}" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_bases_four_workers_every_request_on_its_base_and_right(fleet):
    router, kind_of, dirs, adapters, root = fleet
    expected = references(dirs, adapters)
    # the adapters change the answer: a right answer is the adapter's own
    assert len({tuple(tokens) for tokens in expected.values()}) >= len(expected) - 2
    base_of = {name: kind for kind, named in adapters.items() for name in named}
    base_of.update({served: kind for kind, served in BASES.items()})
    names = sorted(base_of)
    results: list[tuple[str, httpx.Response]] = []

    def client(offset: int):
        for i in range(30):
            model = names[(offset + 7 * i) % len(names)]
            results.append((model, complete(router.url, model)))

    clients = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert len(results) == 120 and {m for m, _ in results} == set(names)
    wrong = [
        (model, r.status_code, r.text[:200])
        for model, r in results
        if r.status_code != 200 or r.json()["choices"][0]["logprobs"]["tokens"] != expected[model]
    ]
    assert not wrong, wrong
    for model, r in results:
        kind = base_of[model]
        assert r.headers["x-loraplex-pool"] == f"pool-{kind}"
        assert kind_of[r.headers["x-loraplex-worker"]] == kind
    # four clients never make a worker look saturated
    assert not [r for _, r in results if r.headers["x-loraplex-route"].startswith("saturated")]
    # what each worker served, from its own audit log: only its base's, and all of it answered
    served: Counter[str] = Counter()

    def logged() -> int:
        return sum(len(audit_lines(root, k, i)) for k in BASES for i in range(2))

    wait_for(lambda: logged() >= 120, "the workers' audit logs")
    for kind in BASES:
        for i in range(2):
            for line in audit_lines(root, kind, i):
                model = line["adapter"] or line["base_model"]
                assert base_of[model] == kind and line["status"] == 200, line
                served[kind] += 1
    assert sum(served.values()) == 120 and set(served) == set(BASES)


def test_a_model_no_worker_can_serve_is_one_clear_error_and_models_are_merged(fleet):
    router, kind_of, _, adapters, _ = fleet
    orphan = complete(router.url, "mi-attn")
    error = orphan.json()["error"]
    assert orphan.status_code == 404 and error["code"] == "model_not_available"
    assert error["message"].startswith("no worker serves base model ")
    assert "(the base of mi-attn@r1)" in error["message"]
    assert "x-loraplex-worker" not in orphan.headers
    too_wide = complete(router.url, "ll-r32").json()["error"]
    assert too_wide["code"] == "model_not_available"
    assert too_wide["message"].startswith("no worker serves adapters of rank 32 on base model ")
    assert too_wide["message"].endswith("(the base of ll-r32@r1)")
    listed = httpx.get(f"{router.url}/v1/models", timeout=30)
    ids = {m["id"] for m in listed.json()["data"]}
    every = {*BASES.values(), *adapters["llama"], *adapters["qwen2"]}
    assert every <= ids and "mi-attn" not in ids
    single = httpx.get(f"{next(iter(kind_of))}/v1/models", timeout=30).json()["data"]
    assert len(single) < len(ids)  # one worker lists its own base's models only
    workers = httpx.get(
        f"{router.url}/admin/workers",
        headers={"Authorization": "Bearer e2e-admin-token-0123456789"},
        timeout=30,
    ).json()["workers"]
    assert {(w["pool"], w["base_model"], w["misconfigured"]) for w in workers} == {
        ("pool-llama", "base-llama", None),
        ("pool-qwen2", "base-qwen", None),
    }


def test_without_pools_the_registry_and_the_workers_reports_keep_each_base_apart(fleet):
    """The four workers as plain `--worker`s (one `default` pool) behind a router with the
    registry: the adapters' bases from the registry and the workers' reported bases route alone."""
    _, kind_of, _, adapters, root = fleet
    registry_url = f"sqlite:///{root / 'registry.db'}"
    router = start_router(
        list(kind_of), root / "router-plain", "affinity", "--registry", registry_url
    )
    try:
        wait_for(lambda: _answers(f"{router.url}/health"), "the router to listen")
        models = [*BASES.values(), *adapters["llama"], *adapters["qwen2"]] * 2
        answers = [(model, complete(router.url, model)) for model in models]
        kind = {served: k for k, served in BASES.items()}
        kind.update({name: k for k, named in adapters.items() for name in named})
        assert [(m, r.status_code) for m, r in answers] == [(m, 200) for m in models]
        assert {r.headers["x-loraplex-pool"] for _, r in answers} == {"default"}
        assert all(kind_of[r.headers["x-loraplex-worker"]] == kind[m] for m, r in answers)
    finally:
        router.stop()
