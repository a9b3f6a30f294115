"""Faults with requests in flight (remote store down, disk budget full) and hostile input, on real
processes."""

from __future__ import annotations

import shutil

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ports import held
from world_fleet import checked_inputs

from loraplex.artifacts import ArtifactStore, serve_store
from loraplex.demo.world import TRANSFORMS, make_prompt
from loraplex.loadgen.procs import start_worker, state
from loraplex.registry import Registry


@pytest.fixture(scope="module")
def good_inputs(demo_world):
    return checked_inputs(demo_world, n=20)


def complete(url, key, model, text="hello", **extra):
    body = {
        "model": model,
        "prompt": make_prompt(text),
        "max_tokens": 30,
        "temperature": 0,
        **extra,
    }
    return httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def test_remote_store_down_and_disk_budget_full(demo_world, good_inputs, tmp_path):
    """Artifacts only in a remote HTTP store: resident adapters keep serving while it is down, cold
    ones get 503 and recover when it returns; a disk budget smaller than the adapters evicts instead
    of failing."""
    port_holder = ArtifactStore(tmp_path / "remote")
    with serve_store(port_holder) as base:
        registry = Registry(
            f"sqlite:///{tmp_path / 'reg' / 'registry.db'}",
            base_model_dir=demo_world.model_dir,
            max_lora_rank=32,
            storage_base=base,
        )
        registry.init()
        registry.add_tenant("acme", 0)
        key = registry.create_key("acme")
        names = sorted(demo_world.adapters)
        for name in names:
            registry.add_revision(demo_world.adapters[name], name, shared=True, status="stable")
        # The registry's local copy goes; the bytes now live only in the remote store.
        shutil.copytree(
            registry.store.root / "sha256", port_holder.root / "sha256", dirs_exist_ok=True
        )
        shutil.rmtree(registry.store.root)
        registry.close()
        biggest = max(port_holder.size(d) for d in port_holder.digests())
        worker = start_worker(
            demo_world.model_dir,
            tmp_path / "w",
            {},
            "--registry",
            registry.url,
            "--allowed-roots",
            base,
            "--disk-cache-bytes",
            str(int(biggest * 2.5)),
            "--max-loras",
            "1",
            "--max-cpu-loras",
            "1",
            max_lora_rank=32,
        )
        try:
            for name in names[1:]:  # each comes over HTTP; the disk budget holds only two of them
                text = good_inputs[name][0]
                r = complete(worker.url, key, name, text)
                assert r.status_code == 200 and r.headers["x-loraplex-cache-tier"] in (
                    "remote",
                    "disk",
                )
                assert r.json()["choices"][0]["text"].strip() == TRANSFORMS[name](text)
            resident = complete(worker.url, key, names[-1])
            assert resident.headers["x-loraplex-cache-tier"] == "gpu"
            disk_bytes = sum(
                p.stat().st_size for p in (tmp_path / "w" / "cache").rglob("*") if p.is_file()
            )
            assert disk_bytes <= biggest * 2.5
            cold_name = names[0]  # never requested: its bytes are only in the remote store
        except BaseException:
            worker.stop()
            raise
    port = int(base.rsplit(":", 1)[1])
    try:
        with held(port):  # the store is down now
            assert complete(worker.url, key, names[-1]).status_code == 200  # resident: still served
            down = complete(worker.url, key, cold_name)
            assert down.status_code == 503 and down.json()["error"]["type"]
            with serve_store(port_holder, port=port):
                text = good_inputs[cold_name][0]
                back = complete(worker.url, key, cold_name, text)
                assert back.status_code == 200
                assert back.json()["choices"][0]["text"].strip() == TRANSFORMS[cold_name](text)
        assert all(a["in_flight"] == 0 for a in state(worker.url)["adapters"])
    finally:
        worker.stop()


HOSTILE_MODELS = [
    "../upper",
    "upper/../../etc/passwd",
    "up\x00per",
    "x" * 5000,
    "http://169.254.169.254/x",
    "file:///etc/passwd",
    "s3://bucket/key",
    "/abs/path",
    "UPPER",
    "upper@../r1",
    "",
    " ",
]


@pytest.fixture(scope="module")
def plain_worker(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    worker = start_worker(
        demo_world.model_dir, root / "w", {"rot13": demo_world.adapters["rot13"]}, max_lora_rank=32
    )
    yield worker
    worker.stop()


@pytest.mark.parametrize("model", HOSTILE_MODELS)
def test_hostile_model_names_are_refused(plain_worker, model):
    r = complete(plain_worker.url, "none", model)
    assert r.status_code in (400, 404), (model, r.status_code, r.text)
    assert set(r.json()["error"]) >= {"message", "type", "code", "param"}


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["rot13", "nope", *HOSTILE_MODELS[:4]]) | st.text(max_size=30),
        "prompt": JSON,
        "messages": JSON,
        "max_tokens": JSON,
        "temperature": JSON,
        "top_p": JSON,
        "n": JSON,
        "stream": JSON,
        "stop": JSON,
        "logprobs": JSON,
        "logit_bias": JSON,
        "seed": JSON,
        "user": JSON,
        "unknown_field": JSON,
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=FIELDS, chat=st.booleans())
def test_fuzzed_bodies_never_get_a_500_and_the_server_keeps_answering(plain_worker, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = max(-5, min(body["max_tokens"], 8))  # keep valid cases fast
    r = httpx.post(plain_worker.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200 and r.headers.get("content-type", "").startswith("application/json"):
        assert "error" in r.json()


def test_server_still_serves_after_the_fuzzing(plain_worker, good_inputs):
    text = good_inputs["rot13"][0]
    r = complete(plain_worker.url, "none", "rot13", text)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip() == TRANSFORMS["rot13"](
        text
    )
