"""The router's fair-share queue over real sockets: a request whose workers are all saturated
waits at the router and goes on when a poll shows room; a tenant's full queue is a 429. The
worker is a small stand-in at the HTTP boundary that reports its queue as `loraplex serve` does."""

import threading

import httpx
from test_router_pools import KEYS, TOKEN, complete, serving, stand_in, state_of, wait_for

from loraplex.router.app import RouterConfig, create_router_app


def waiting_gauge(url: str, tenant: str) -> str | None:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'loraplex_router_tenant_waiting{{tenant="{tenant}"}}'):
            return line.split()[-1]
    return None


def test_a_saturated_fleet_holds_requests_at_the_router_until_a_poll_shows_room():
    state = state_of("base-a", waiting=9)  # above the saturation threshold of 5
    with serving(stand_in(state)) as one:
        config = RouterConfig(
            workers=(one,),
            admin_token=TOKEN,
            poll_interval_s=0.05,
            caller_of=lambda key: KEYS.get(key, (None, 0)),
            queue_per_tenant=1,
        )
        with serving(create_router_app(config)) as url:
            answers: list[httpx.Response] = []
            waiting = threading.Thread(
                target=lambda: answers.append(complete(url, "sql", "acme-key"))
            )
            waiting.start()
            wait_for(lambda: waiting_gauge(url, "acme") == "1.0", "the request to wait")
            full = complete(url, "sql", "acme-key")
            assert full.status_code == 429 and full.json()["error"]["code"] == "saturated"
            assert "1 requests of tenant acme are waiting" in full.json()["error"]["message"]
            other = threading.Thread(
                target=lambda: answers.append(complete(url, "sql", "beta-key"))
            )
            other.start()  # another tenant's queue has room of its own
            wait_for(lambda: waiting_gauge(url, "beta") == "1.0", "beta's request to wait")
            assert answers == []
            state["load"]["waiting"] = 0
            waiting.join()
            other.join()
            assert sorted(r.status_code for r in answers) == [200, 200]
            assert waiting_gauge(url, "acme") == "0.0"
            metrics = httpx.get(f"{url}/metrics").text
            assert 'loraplex_router_tenant_granted_total{tenant="acme"} 1.0' in metrics
