"""Tenancy: keys map to tenants; a tenant sees and uses only its own, shared and granted
adapters."""

import httpx
import openai
import pytest
from harness import KEYS, MODEL


def _models(running, tenant):
    return sorted(m.id for m in running.client(tenant).models.list())


def test_models_lists_only_what_the_tenant_may_use(running):
    assert _models(running, "alice") == sorted([MODEL, "shared-a", "alice-a"])
    assert _models(running, "bob") == sorted([MODEL, "shared-a", "bob-a"])
    cards = {m.id: m for m in running.client("alice").models.list()}
    assert cards["alice-a"].parent == MODEL and cards[MODEL].parent is None


def _post(running, tenant, model):
    return httpx.post(
        f"{running.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        json={"model": model, "prompt": "x", "max_tokens": 1},
    )


def test_another_tenants_adapter_answers_exactly_like_an_unknown_name(running):
    for model in ("bob-a", "bob-a@r1"):
        theirs = _post(running, "alice", model)
        unknown = _post(running, "alice", model.replace("bob-a", "zzz-a"))
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json() == {
            "error": {
                **unknown.json()["error"],
                "message": unknown.json()["error"]["message"].replace("zzz-a", "bob-a"),
            }
        }
        assert theirs.headers["x-loraplex-adapter"] == unknown.headers["x-loraplex-adapter"] == ""
    assert _post(running, "bob", "bob-a").status_code == 200
    with pytest.raises(openai.NotFoundError):
        running.client("alice").chat.completions.create(
            model="bob-a", messages=[{"role": "user", "content": "x"}]
        )


def test_no_key_or_a_wrong_key_is_401(running):
    no_key = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert no_key.headers["x-request-id"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{running.url}/v1", api_key="wrong-key-0123456789", max_retries=0
        ).models.list()
    bad_scheme = httpx.get(
        f"{running.url}/v1/models", headers={"Authorization": f"Basic {KEYS['alice']}"}
    )
    assert bad_scheme.status_code == 401


def test_grants_open_an_adapter_to_another_tenant(running):
    running.registry.grant("bob-a", "alice")
    try:
        assert "bob-a" in _models(running, "alice")
        assert _post(running, "alice", "bob-a").status_code == 200
    finally:
        running.registry.revoke_grant("bob-a", "alice")
    assert _post(running, "alice", "bob-a").status_code == 404


def test_open_mode_serves_tenant_default_shared_adapters_only(start):
    with start(keys=False) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="anything", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == sorted([MODEL, "shared-a"])
        assert (
            client.completions.create(
                model="shared-a", prompt="x", max_tokens=1
            ).usage.completion_tokens
            == 1
        )
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alice-a", prompt="x", max_tokens=1)


def test_registry_keys_authenticate_and_a_revoked_key_stops_working(start):
    key = "lpx-registry-key-for-alice-0123"
    with start(
        keys=False, key_cache_ttl_s=0.0, registry_setup=lambda r: r.add_key("alice", key)
    ) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0)
        assert "alice-a" in [m.id for m in client.models.list()]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{running.url}/v1", api_key="lpx-not-a-key-000000000", max_retries=0
            ).models.list()
        running.registry.revoke_key(key)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
