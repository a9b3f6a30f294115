"""Read-your-writes for the catalog: a load, registration, promotion or unload made through a
server shows in that server's `/v1/models` as soon as the call returns, over a real socket, every
time. The change feed (SQLite's `data_version`, polled) is set to look once an hour, so that only
the server's own commits can make the listing current."""

import httpx
import pytest
from harness import KEYS

from loraplex.registry import changes

ALICE = {"Authorization": f"Bearer {KEYS['alice']}"}
TRIES = 20


@pytest.fixture(autouse=True)
def _feed_looks_once_an_hour(monkeypatch):
    monkeypatch.setattr(changes, "SQLITE_POLL_S", 3600.0)


def _listed(running) -> dict[str, str]:
    """id -> root of each card in alice's `/v1/models`."""
    response = httpx.get(f"{running.url}/v1/models", headers=ALICE, timeout=60)
    assert response.status_code == 200, response.text
    return {card["id"]: card["root"] for card in response.json()["data"]}


def test_a_loaded_adapter_is_listed_as_soon_as_the_load_returns(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots) as running:
        for i in range(TRIES):  # in a row: each one, not most of them
            name = f"dyn{i:02d}"
            body = {"lora_name": name, "lora_path": str(adapter_variants[i])}
            loaded = running.admin("POST", "/v1/load_lora_adapter", json=body)
            assert loaded.status_code == 200, loaded.text
            assert name in _listed(running), f"try {i}: {name} not listed after its load"
        for i in range(0, TRIES, 4):
            name = f"dyn{i:02d}"
            unloaded = running.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
            assert unloaded.status_code == 200, unloaded.text
            assert name not in _listed(running), f"{name} still listed after its unload"


def test_a_registration_and_a_promotion_are_listed_as_soon_as_they_return(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots) as running:
        for i in range(TRIES // 2):
            name = f"alice-{i:02d}"
            body = {"name": name, "path": str(adapter_variants[i]), "tenant": "alice"}
            first = running.admin("POST", "/admin/adapters", json={**body, "stable": True})
            assert first.status_code == 200, first.text
            assert _listed(running).get(name) == f"{name}@r1"
            body["path"] = str(adapter_variants[TRIES - 1 - i])
            second = running.admin("POST", "/admin/adapters", json={**body, "stable": False})
            assert second.status_code == 200, second.text
            revision = second.json()["revision"]
            assert _listed(running)[name] == f"{name}@r1"  # staged: no traffic yet
            promote = {"revision": revision}
            promoted = running.admin("POST", f"/admin/adapters/{name}/promote", json=promote)
            assert promoted.status_code == 200, promoted.text
            assert _listed(running)[name] == f"{name}@{revision}"
