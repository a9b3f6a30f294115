"""The placement endpoints of a worker's admin API over a real server (uvicorn, the native engine,
a SQLite registry): a placement pins one revision on this worker alone and its state lists it;
a release drops that pin and leaves an operator's; a draining worker takes no placement and says
drained once nothing is placed and nothing is in flight."""

from __future__ import annotations

import httpx
import pytest
from harness import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def worker(start):
    with start(engine={"max_loras": 4}) as running:
        yield running


def call(method: str, url: str, body: dict | None = None, headers=ADMIN) -> httpx.Response:
    return httpx.request(method, url, json=body, headers=headers, timeout=60)


def rows(url: str, name: str) -> list[tuple[str, str, str | None]]:
    state = call("GET", f"{url}/admin/state").json()
    return [(a["revision"], a["tier"], a["pinned"]) for a in state["adapters"] if a["name"] == name]


def test_a_placement_pins_the_revision_here_alone_and_a_release_drops_it(worker):
    url = worker.url
    placed = call("POST", f"{url}/admin/placement/shared-a@r1", {"tier": "gpu"})
    assert placed.status_code == 200, placed.text
    assert placed.json() == {"placed": ["shared-a@r1"], "tier": "gpu"}
    assert rows(url, "shared-a") == [("r1", "gpu", "gpu")]
    state = call("GET", f"{url}/admin/state").json()
    assert (state["placed"], state["drain"]) == (["shared-a@r1"], None)
    routing = call("GET", f"{url}/admin/state?view=routing").json()
    assert routing["placed"] == ["shared-a@r1"]
    assert worker.registry.show("shared-a").pinned is False  # no other worker follows it
    released = call("DELETE", f"{url}/admin/placement/shared-a@r1")
    assert released.json() == {"released": ["shared-a@r1"]}
    assert rows(url, "shared-a") == [("r1", "gpu", None)]
    assert call("GET", f"{url}/admin/state").json()["placed"] == []


def test_a_release_leaves_an_operators_pin(worker):
    url = worker.url
    assert call("POST", f"{url}/admin/placement/shared-a", {"tier": "cpu"}).status_code == 200
    pinned = call("POST", f"{url}/admin/adapters/shared-a/pin", {"tier": "cpu", "revision": "r1"})
    assert pinned.status_code == 200, pinned.text
    assert call("DELETE", f"{url}/admin/placement/shared-a").json() == {"released": ["shared-a@r1"]}
    assert rows(url, "shared-a")[0][2] == "cpu"  # the operator's pin stands


def test_a_draining_worker_takes_no_placement_and_reports_drained(worker):
    url = worker.url
    assert call("POST", f"{url}/admin/placement/shared-a@r1").status_code == 200
    assert call("POST", f"{url}/admin/drain").json() == {
        "placed": ["shared-a@r1"],
        "drain": "draining",
    }
    refused = call("POST", f"{url}/admin/placement/alice-a")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "draining"
    assert call("DELETE", f"{url}/admin/placement/shared-a@r1").status_code == 200
    assert call("GET", f"{url}/admin/state").json()["drain"] == "drained"
    assert call("DELETE", f"{url}/admin/drain").json() == {"placed": [], "drain": None}


def test_the_placement_endpoints_need_the_admin_token_and_a_registered_adapter(worker):
    url = worker.url
    for method, path in (
        ("POST", "/admin/placement/shared-a"),
        ("DELETE", "/admin/placement/shared-a"),
        ("POST", "/admin/drain"),
    ):
        assert call(method, f"{url}{path}", headers={}).status_code == 401
    unknown = call("POST", f"{url}/admin/placement/nobody@r1")
    assert unknown.status_code == 404, unknown.text
    assert call("GET", f"{url}/admin/state").json()["placed"] == []
