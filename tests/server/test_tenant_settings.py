"""Tenant fields of the registry reaching a server: request limits, and the priority that
keep_score weighs; signatures checked on every path that registers or loads an adapter."""

import threading

import openai
import pytest
from harness import MODEL

from loraplex.artifacts import canonical_digest
from loraplex.registry.signing import (
    SIGNATURE_FILE,
    generate_keypair,
    load_private_key,
    sign_digest,
)

# room for a stream that outlives the test steps
LONG = {
    "max_model_len": 4096,
    "kv_cache_memory_bytes": 16 * 2**20,
}


def _open_stream(running, tenant: str, model: str):
    stream = running.client(tenant).completions.create(
        model=model, prompt="x", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    return stream


def test_tenant_limit_from_the_registry_replaces_the_servers(start):
    def limits(registry):
        registry.set_tenant_limits("alice", max_concurrent_requests=1)

    # the server's own limit (256) is far above; alice's registry field is 1, bob has none
    with start(engine=LONG, registry_setup=limits) as running:
        stream = _open_stream(running, "alice", MODEL)
        with pytest.raises(openai.RateLimitError) as refused:
            running.client("alice").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert refused.value.body["code"] == "tenant_quota_exceeded"
        assert "1 requests in flight" in refused.value.body["message"]
        second = _open_stream(running, "bob", MODEL)
        assert running.client("bob").completions.create(model=MODEL, prompt="x", max_tokens=1).usage
        stream.close()
        second.close()


def test_tenant_waiting_limit_from_the_registry(start):
    def limits(registry):
        registry.set_tenant_limits("alice", max_waiting=1)

    with start(engine={"max_loras": 1, **LONG}, registry_setup=limits) as running:
        holder = _open_stream(running, "bob", "shared-a")  # holds the only slot
        waiting: dict = {}

        def wait_for_slot():
            waiting["result"] = running.client("alice").completions.create(
                model="alice-a", prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
            )

        thread = threading.Thread(target=wait_for_slot)
        thread.start()
        running.wait_for(
            lambda: running.state()["load"]["admitted_waiting"] == 1, what="a waiting request"
        )
        with pytest.raises(openai.RateLimitError) as refused:
            running.client("alice").completions.create(model="alice-a", prompt="x", max_tokens=1)
        assert "1 requests waiting" in refused.value.body["message"]
        holder.close()
        thread.join(60)
        assert waiting["result"].usage.completion_tokens == 2


@pytest.mark.parametrize(
    "priorities, kept", [({"alice": 5, "bob": 0}, "alice-a"), ({"alice": 0, "bob": 5}, "bob-a")]
)
def test_tenant_priority_changes_what_the_cache_keeps(start, priorities, kept):
    """Two slots: alice-a, then bob-a, then shared-a needs a slot. Equal demand, so the victim is
    the adapter whose tenant has the lower priority, whichever was used last."""

    def setup(registry):
        for tenant, priority in priorities.items():
            registry.add_tenant(tenant, priority)

    with start(engine={"max_loras": 2}, registry_setup=setup) as running:
        for tenant, model in (("alice", "alice-a"), ("bob", "bob-a"), ("alice", "shared-a")):
            running.client(tenant).completions.create(model=model, prompt="x", max_tokens=1)
        on_gpu = {a["name"] for a in running.state()["adapters"] if a["tier"] == "gpu"}
        assert on_gpu == {kept, "shared-a"}


@pytest.fixture
def keys(tmp_path):
    private, public = generate_keypair()
    (tmp_path / "release.key").write_bytes(private)
    (tmp_path / "release.pub").write_bytes(public)
    return load_private_key(tmp_path / "release.key"), tmp_path / "release.pub"


def _signed_copy(src, out, key):
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / SIGNATURE_FILE).write_text(sign_digest(canonical_digest(out), key) + "\n")
    return out


def test_trusted_keys_guard_admin_register_vllm_load_and_registry_loads(
    start, keys, llama_adapters, tmp_path
):
    from loraplex.registry.signing import load_public_key

    private, public = keys
    signed = _signed_copy(llama_adapters["pattern"], tmp_path / "signed", private)
    unsigned = _signed_copy(llama_adapters["all-r16-rslora"], tmp_path / "unsigned", private)
    (unsigned / SIGNATURE_FILE).unlink()

    def trust(registry):
        registry.registration.trusted_keys = (load_public_key(public),)

    with start(registry_setup=trust, allowed_roots=(str(tmp_path),)) as running:
        # registry loads: shared-a was registered unsigned, before the keys were configured
        with pytest.raises(openai.InternalServerError) as refused:
            running.client("alice").completions.create(model="shared-a", prompt="x", max_tokens=1)
        assert refused.value.status_code == 503 and "unsigned" in refused.value.body["message"]
        # admin register: refused unsigned, accepted with the signature file or the body's field
        body = {"name": "ops", "path": str(unsigned), "shared": True, "stable": True}
        response = running.admin("POST", "/admin/adapters", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "signature"
        body["signature"] = sign_digest(canonical_digest(unsigned), private)
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        assert (
            running.client("alice").completions.create(model="ops", prompt="x", max_tokens=1).usage
        )
        # vLLM's load call: the unsigned directory is refused, the signed one serves
        response = running.admin(
            "POST",
            "/v1/load_lora_adapter",
            json={"lora_name": "loaded", "lora_path": str(unsigned)},
        )
        assert response.status_code == 400 and "unsigned" in response.json()["error"]["message"]
        response = running.admin(
            "POST", "/v1/load_lora_adapter", json={"lora_name": "loaded", "lora_path": str(signed)}
        )
        assert response.status_code == 200, response.text
        assert (
            running.client("bob").completions.create(model="loaded", prompt="x", max_tokens=1).usage
        )
