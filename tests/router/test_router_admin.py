"""The router's admin routes over a real socket: a token anyone can send and a body that is not JSON
get answers in the OpenAI error shape, not a server error."""

import sys
from pathlib import Path

import httpx

from loraplex.router.app import RouterConfig, create_router_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import serving  # noqa: E402 (the tests' uvicorn-in-a-thread runner)

TOKEN = "admin-token-0123456789"


def test_a_non_ascii_token_and_a_body_that_is_not_json_are_client_errors():
    app = create_router_app(RouterConfig(workers=("http://127.0.0.1:9",), admin_token=TOKEN))
    with serving(app) as url:
        odd = httpx.get(
            f"{url}/admin/workers", headers={"Authorization": "Bearer \xe9".encode("latin-1")}
        )
        assert odd.status_code == 401 and odd.json()["error"]["code"] == "unauthorized"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for method in ("POST", "DELETE"):
            bad = httpx.request(method, f"{url}/admin/workers", headers=auth, content=b"{bad")
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", (
                bad.text
            )
        listed = httpx.get(f"{url}/admin/workers", headers=auth)
        assert listed.status_code == 200 and [w["url"] for w in listed.json()["workers"]] == [
            "http://127.0.0.1:9"
        ]
