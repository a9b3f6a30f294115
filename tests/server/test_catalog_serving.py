"""A server answers from its catalog in memory: no registry statement per request at steady state,
its own commits served to the next request, `/v1/models` paged as OpenAI's lists are, and no stall
of the streams in flight while `/v1/models`, a registration, a change made elsewhere and requests
with a key only the registry knows run against a registry whose every statement takes 0.4 s (and
no lateness of the server's event loop past a quarter of a second, where a held loop shows)."""

import json
import threading
import time
from json.encoder import encode_basestring_ascii as _quoted

import httpx
from harness import KEYS, MODEL
from sqlalchemy import event
from test_metrics_audit import _samples, _value

from loraplex.registry import Registry
from loraplex.server.listing import adapter_card
from loraplex.server.schemas import model_card

SLOW_S = 0.4
STALL_S = 0.25  # generous: an event loop blocked by one slow statement stalls its streams longer


def _late_loop(url: str) -> tuple[float, float]:
    """The server's loop-lag samples: all of them, and those later than STALL_S."""
    s = _samples(url)
    name = "loraplex_event_loop_lag_seconds"
    count = _value(s, f"{name}_count")
    return count, count - _value(s, f"{name}_bucket", le=str(STALL_S))


def _statements(engine) -> list[str]:
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _cur, sql, *_: seen.append(sql))
    return seen


def _complete(running, model: str, tenant: str = "alice") -> httpx.Response:
    return httpx.post(
        f"{running.url}/v1/completions",
        json={"model": model, "prompt": "x", "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    )


def test_requests_at_steady_state_send_no_statement_to_the_registry(start):
    with start() as running:
        for model in ("shared-a", "alice-a", MODEL):  # each digest's first request reads its files
            assert _complete(running, model).status_code == 200
        seen = _statements(running.registry.engine)
        for i in range(30):
            model = ("shared-a", "alice-a", "shared-a@r1", MODEL)[i % 4]
            assert _complete(running, model).status_code == 200
        assert running.client("alice").models.list().data
        assert _complete(running, "bob-a").status_code == 404
        assert seen == []


def test_this_servers_registry_commits_reach_the_next_request(start, adapter_variants):
    with start(registry_watch_s=3600) as running:
        registry = running.registry
        second = registry.add_revision(adapter_variants[0], "shared-a").revision
        registry.promote("shared-a", second, 100, force=True)
        served = _complete(running, "shared-a")
        assert served.headers["x-loraplex-adapter"] == f"shared-a@{second}"
        registry.quarantine("shared-a", second, "bad bytes")
        assert _complete(running, "shared-a").headers["x-loraplex-adapter"] == "shared-a@r1"
        assert _complete(running, f"shared-a@{second}").status_code == 404


def test_models_pages_as_openai_lists_do(start, adapter_variants):
    def page(**params):
        response = httpx.get(
            f"{running.url}/v1/models",
            params=params,
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
        )
        assert response.status_code == 200, response.text
        return response.json()

    def setup(registry: Registry):
        for i, path in enumerate(adapter_variants[:5]):
            registry.add_revision(path, f"extra-{i}", shared=True, status="stable")

    with start(registry_setup=setup) as running:
        whole = [m["id"] for m in page()["data"]]
        assert whole[0] == MODEL and whole[1:] == sorted(whole[1:]) and len(whole) == 8
        first = page(limit=3)
        assert [m["id"] for m in first["data"]] == whole[:3]
        assert (first["has_more"], first["first_id"], first["last_id"]) == (True, MODEL, whole[2])
        rest = page(after=first["last_id"], limit=10)
        assert [m["id"] for m in rest["data"]] == whole[3:] and rest["has_more"] is False
        assert [m["id"] for m in page(after="extra-0a")["data"]] == whole[whole.index("extra-1") :]
        bad = httpx.get(f"{running.url}/v1/models", params={"limit": "0"})
        assert bad.status_code in (400, 401)
        authorized = {"Authorization": f"Bearer {KEYS['alice']}"}
        bad = httpx.get(f"{running.url}/v1/models", params={"limit": "x"}, headers=authorized)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


class _Streams:
    """Streams of the base model, one after another on a thread, recording the gaps between the
    chunks of each."""

    def __init__(self, url: str):
        self.url, self.gaps, self.chunks = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(60)

    def _run(self):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 64, "stream": True}
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                last = None
                with client.stream(
                    "POST", f"{self.url}/v1/completions", json=body, headers=headers
                ) as r:
                    for line in r.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: "):
                            if last is not None:
                                self.gaps.append(now - last)
                            last, self.chunks = now, self.chunks + 1


def test_streams_do_not_stall_while_catalog_operations_meet_a_slow_registry(
    start, adapter_variants, llama_dir
):
    roots = (str(adapter_variants[0].parent),)
    registry_key = "carol-key-0123456789ab"

    def setup(registry: Registry):
        registry.add_tenant("carol")
        registry.add_key("carol", registry_key)

    with start(allowed_roots=roots, registry_setup=setup, key_cache_ttl_s=0.0) as running:
        other = Registry(running.registry.url, running.registry.store, base_model_dir=llama_dir)
        try:
            event.listen(
                running.registry.engine,
                "before_cursor_execute",
                lambda *_: time.sleep(SLOW_S),  # the server's registry: every statement is slow
            )
            with _Streams(running.url) as streams:
                while streams.chunks < 5:
                    time.sleep(0.01)
                before, (_, late_before) = streams.chunks, _late_loop(running.url)
                models = running.client("alice").models.list()
                loaded = httpx.post(
                    f"{running.url}/v1/load_lora_adapter",
                    json={"lora_name": "fresh", "lora_path": str(adapter_variants[0])},
                    headers={"Authorization": f"Bearer {running.server.config.admin_token}"},
                    timeout=120,
                )
                assert loaded.status_code == 200, loaded.text
                for _ in range(2):  # each looks its key up in the registry (no cache: ttl 0)
                    carol = httpx.get(
                        f"{running.url}/v1/models",
                        headers={"Authorization": f"Bearer {registry_key}"},
                        timeout=60,
                    )
                    assert carol.status_code == 200, carol.text
                assert _complete(running, "fresh").status_code == 200
                other.add_revision(adapter_variants[1], "elsewhere", shared=True, status="stable")
                running.wait_for(
                    lambda: running.server.catalog.adapter("elsewhere") is not None,
                    what="the change made elsewhere",
                )
                during = streams.chunks - before
                _, late_after = _late_loop(running.url)
            stalls = [g for g in streams.gaps if g > STALL_S]
            assert MODEL in [m.id for m in models.data]
            assert during > 20 and stalls == [], (during, sorted(streams.gaps)[-5:])
            assert late_after == late_before
        finally:
            other.close()


def test_a_held_event_loop_shows_in_the_loop_lag_series(start):
    """One callback that holds the server's loop for SLOW_S: exactly one sample later than STALL_S
    (the timer due under it; the next is set after it), and the samples go on."""
    with start() as running:
        count, late = _late_loop(running.url)
        assert count > 0
        loop = running.server.loop_lag.loop
        assert loop is not None
        loop.call_soon_threadsafe(time.sleep, SLOW_S)
        running.wait_for(lambda: _late_loop(running.url)[1] > late, what="a late sample")
        time.sleep(0.05)
        count_after, late_after = _late_loop(running.url)
        assert late_after == late + 1 and count_after > count + 1


def test_start_and_listing_touch_no_artifact_and_a_first_request_reads_its_own(
    start, adapter_variants
):
    looked: list[str] = []

    def setup(registry: Registry):
        for i, path in enumerate(adapter_variants[:6]):
            registry.add_revision(path, f"many-{i}", shared=True, status="stable")
        store = registry.store
        has, pieces = store.has, registry.pieces
        store.has = lambda digest: looked.append(digest) or has(digest)
        registry.pieces = lambda digest: looked.append(digest) or pieces(digest)

    with start(registry_setup=setup) as running:
        listed = [m.id for m in running.client("alice").models.list()]
        assert [n for n in listed if n.startswith("many-")] == [f"many-{i}" for i in range(6)]
        assert looked == []  # the start and the listing read the catalog, no artifact
        assert _complete(running, "many-3").status_code == 200
        digest = running.server.catalog.adapter("many-3").revisions[0].digest
        assert set(looked) == {digest}
        _complete(running, "many-3")
        assert set(looked) == {digest} and len(looked) == 2  # once per digest: a stat, a read


def test_an_adapters_card_is_what_its_model_card_encodes_to():
    """The listing formats the cards; each one decodes to `model_card`'s dict, field for field and
    in its order, whatever a name holds."""
    for name, owner, parent, root in [
        ("ad-1", "shared", "tiny", "ad-1@v1"),
        ("x.y_z", "alice", 'odd "served" \\ name é', "x.y_z@r.2"),
    ]:
        card = adapter_card(name, owner, _quoted(parent), root, 1_700_000_000)
        expected = model_card(name, owner, parent, root=root) | {"created": 1_700_000_000}
        assert list(json.loads(card).items()) == list(expected.items())
