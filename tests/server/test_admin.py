"""The admin API: the token, residency state, registry changes, cache operations, vLLM's
load/unload."""

import threading
from datetime import timedelta

import httpx
import openai
import pytest
from harness import ADMIN_TOKEN, KEYS, MODEL, serving

from loraplex.registry import Registry
from loraplex.server.app import create_admin_app


def test_admin_without_token_is_401_and_with_a_wrong_one_too(running):
    for token in (None, "wrong-token-0123456789"):
        for method, path in (("GET", "/admin/state"), ("POST", "/v1/load_lora_adapter")):
            response = running.admin(method, path, token=token, json={})
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
    # a tenant key is not it
    assert running.admin("GET", "/admin/state", token=KEYS["alice"]).status_code == 401


JSON = {"content-type": "application/json"}


def test_without_the_token_the_body_is_not_read(running):
    """401 comes before the body: not JSON is no 400 (which would tell anyone the admin API is
    there), and a large body is refused as small ones are."""
    for path in ("/v1/load_lora_adapter", "/admin/adapters", "/admin/adapters/shared-a/promote"):
        response = httpx.post(f"{running.url}{path}", content=b"{not json", headers=JSON)
        assert (
            response.status_code == 401
            and response.json()["error"]["code"] == "invalid_admin_token"
        ), path
    big = b'{"lora_name": "x", "lora_path": "' + b"a" * (8 << 20) + b'"}'
    response = httpx.post(f"{running.url}/v1/load_lora_adapter", content=big, headers=JSON)
    assert response.status_code == 401
    with_token = httpx.post(
        f"{running.url}/admin/adapters/shared-a/promote",
        content=b"{not json",
        headers={"content-type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    # with the token, the body is read and checked
    assert with_token.status_code == 400, with_token.text


def test_admin_api_is_404_when_off(start):
    with start(admin_token=None) as running:
        for method, path in (
            ("GET", "/admin/state"),
            ("GET", "/admin/adapters"),
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/v1/unload_lora_adapter"),
        ):
            assert running.admin(method, path, json={}).status_code == 404


def test_state_reports_residency_and_load(running):
    running.client().completions.create(model="shared-a", prompt="x", max_tokens=1)
    state = running.state()
    entry = next(a for a in state["adapters"] if a["name"] == "shared-a")
    assert (
        entry["tier"] == "gpu"
        and entry["in_flight"] == 0
        and entry["bytes"] > 0
        and entry["hits"] >= 1
    )
    for field in ("digest", "revision", "pinned", "loads", "evictions"):
        assert field in entry
    for field in ("waiting", "running", "active_tokens", "recent_evictions", "free_slots"):
        assert field in state["load"]
    assert state["max_loras"] == 2
    # what a router checks against the worker's pool, in the whole state and the routing view
    routing = running.admin("GET", "/admin/state", params={"view": "routing"}).json()
    for view in (state, routing):
        assert view["base_model"] == "tiny" and view["base_model_digest"].startswith("sha256:")
        assert view["max_lora_rank"] == 16  # the engine's, as the test server makes it


def test_register_promote_rollback_through_the_admin_api(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots) as running:
        body = {
            "name": "alice-b",
            "path": str(adapter_variants[0]),
            "tenant": "alice",
            "stable": True,
        }
        first = running.admin("POST", "/admin/adapters", json=body)
        assert first.status_code == 200, first.text
        assert "alice-b" in [m.id for m in running.client("alice").models.list()]
        assert "alice-b" not in [m.id for m in running.client("bob").models.list()]
        second = running.admin(
            "POST",
            "/admin/adapters",
            json={**body, "path": str(adapter_variants[2]), "stable": False},
        )
        revision = second.json()["revision"]
        promoted = running.admin(
            "POST", "/admin/adapters/alice-b/promote", json={"revision": revision}
        )
        assert promoted.status_code == 200, promoted.text
        served = running.client("alice").completions.with_raw_response.create(
            model="alice-b", prompt="x", max_tokens=1
        )
        assert served.headers["x-loraplex-adapter"] == f"alice-b@{revision}"
        assert running.admin("POST", "/admin/adapters/alice-b/rollback").status_code == 200
        back = running.client("alice").completions.with_raw_response.create(
            model="alice-b", prompt="x", max_tokens=1
        )
        assert back.headers["x-loraplex-adapter"] == "alice-b@r1"
        shown = running.admin("GET", "/admin/adapters/alice-b").json()
        assert [r["revision"] for r in shown["revisions"]] == ["r1", revision]
        assert running.admin("GET", "/admin/adapters").json()["adapters"]


def test_registering_outside_the_allowed_roots_is_refused(running, tmp_path, adapter_variants):
    response = running.admin(
        "POST", "/admin/adapters", json={"name": "sneaky", "path": str(adapter_variants[0])}
    )
    assert (
        response.status_code == 400 and response.json()["error"]["code"] == "location_not_allowed"
    )
    relative = running.admin("POST", "/admin/adapters", json={"name": "sneaky", "path": "../x"})
    assert relative.status_code == 400


def test_prewarm_and_pin_load_ahead_of_traffic(running):
    assert running.admin("POST", "/admin/adapters/bob-a/prewarm").status_code == 200  # no body: cpu
    running.wait_for(lambda: _tier(running, "bob-a") in ("cpu", "gpu"), what="the prewarm")
    pinned = running.admin("POST", "/admin/adapters/alice-a/pin", json={"tier": "gpu"})
    assert pinned.status_code == 200, pinned.text
    running.wait_for(
        lambda: _tier(running, "alice-a") == "gpu", what="the pinned adapter in a slot"
    )
    assert _entry(running, "alice-a")["pinned"] == "gpu"


def test_pin_unpin_evict(running):
    running.client().completions.create(model="alice-a", prompt="x", max_tokens=1)
    pinned = running.admin("POST", "/admin/adapters/alice-a/pin", json={"tier": "gpu"})
    assert pinned.status_code == 200, pinned.text
    assert _entry(running, "alice-a")["pinned"] == "gpu"
    assert running.registry.show("alice-a").pin_tier == "gpu"  # the tier, for the next start
    assert running.admin("POST", "/admin/adapters/alice-a/unpin").status_code == 200
    assert _entry(running, "alice-a")["pinned"] is None
    assert (
        running.registry.show("alice-a").pin_tier is None
        and not running.registry.show("alice-a").pinned
    )
    # no body: every default (it was a 400)
    evicted = running.admin("POST", "/admin/adapters/alice-a/evict")
    assert evicted.status_code == 200 and evicted.json()["evicted"] == ["alice-a@r1"]
    assert _tier(running, "alice-a") not in ("gpu", "cpu")
    assert running.admin("POST", "/admin/adapters/nope/evict", json={}).json()["evicted"] == []
    assert running.admin("POST", "/admin/adapters/nope/prewarm", json={}).status_code == 404


def test_a_start_pins_each_pinned_adapter_again_in_its_tier(start):
    """What a pin recorded in the registry (by the admin API of an earlier run, or `registry pin
    --tier`) is pinned again at the next start, in the same tier: a gpu pin stayed a cpu pin after a
    restart before."""

    def register(registry):
        registry.pin("alice-a", tier="gpu")
        registry.pin("bob-a", tier="cpu")

    with start(registry_setup=register) as running:
        running.wait_for(
            lambda: (
                _entry(running, "alice-a")
                and _entry(running, "alice-a")["pinned"] == "gpu"
                and _tier(running, "alice-a") == "gpu"
            ),
            what="alice-a pinned in a slot",
        )
        running.wait_for(
            lambda: _entry(running, "bob-a") and _entry(running, "bob-a")["pinned"] == "cpu",
            what="bob-a pinned in host memory",
        )
        assert _entry(running, "shared-a") is None or _entry(running, "shared-a")["pinned"] is None


def test_a_warm_policy_pins_in_its_tier_at_start_and_at_registration(start, adapter_variants):
    """A manifest's warm policy of gpu or cpu is a pin (issue: "Pins (gpu or cpu), from the
    manifest's warm_policy or the admin API"); it was a prewarm, evictable like any other copy."""

    def register(registry):
        registry.add_revision(
            adapter_variants[0], "warm-gpu", shared=True, status="stable", warm_policy="gpu"
        )

    roots = (str(adapter_variants[0].parent),)
    with start(registry_setup=register, allowed_roots=roots) as running:
        running.wait_for(
            lambda: (
                _entry(running, "warm-gpu")
                and _entry(running, "warm-gpu")["pinned"] == "gpu"
                and _tier(running, "warm-gpu") == "gpu"
            ),
            what="warm-gpu pinned in a slot",
        )
        body = {
            "name": "warm-cpu",
            "path": str(adapter_variants[1]),
            "shared": True,
            "stable": True,
            "warm": "cpu",
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        running.wait_for(
            lambda: _entry(running, "warm-cpu") and _entry(running, "warm-cpu")["pinned"] == "cpu",
            what="warm-cpu pinned in host memory",
        )
        # the policy pins; no operator pin is recorded
        assert not running.registry.show("warm-cpu").pinned


def _pin_of(running, name, revision):
    entry = next(
        (a for a in running.state()["adapters"] if a["name"] == name and a["revision"] == revision),
        None,
    )
    return entry["pinned"] if entry else None


def test_pins_follow_traffic_and_a_retired_revision_stays_warm_for_the_grace_period(
    start, adapter_variants
):
    """A name's pin moves to the revision promoted after it (rather than hold a slot for the old
    one for good, with a second pin of the name answered 409), for a promote here and for a
    rollback made by another process (the registry CLI); the revision that leaves traffic is kept
    in host memory for the registry's grace period."""

    def register(registry):
        registry.pin("shared-a", tier="gpu")

    roots = (str(adapter_variants[0].parent),)
    with start(registry_setup=register, allowed_roots=roots, registry_watch_s=0.1) as running:
        running.wait_for(
            lambda: _pin_of(running, "shared-a", "r1") == "gpu", what="r1 pinned at start"
        )
        body = {
            "name": "shared-a",
            "path": str(adapter_variants[4]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        promoted = running.admin(
            "POST", "/admin/adapters/shared-a/promote", json={"revision": "r2"}
        )
        assert promoted.status_code == 200, promoted.text
        assert _pin_of(running, "shared-a", "r2") == "gpu"
        # the grace period: a rollback finds it warm
        assert _pin_of(running, "shared-a", "r1") == "cpu"
        again = running.admin("POST", "/admin/adapters/shared-a/pin", json={"tier": "gpu"})
        assert again.status_code == 200, again.text
        # A rollback by another process: the server sees the registry change and moves the pins.
        running.registry.reading.grace_period = timedelta(seconds=5)  # r2's, from now on
        elsewhere = Registry(f"sqlite:///{running.tmp}/registry.db")
        elsewhere.rollback("shared-a")
        elsewhere.close()
        running.wait_for(
            lambda: (
                (_pin_of(running, "shared-a", "r1"), _pin_of(running, "shared-a", "r2"))
                == ("gpu", "cpu")
            ),
            what="r1 pinned and r2 kept warm after the rollback",
        )
        served = running.client().completions.with_raw_response.create(
            model="shared-a", prompt="x", max_tokens=1
        )
        assert served.headers["x-loraplex-adapter"] == "shared-a@r1"
        running.wait_for(
            lambda: _pin_of(running, "shared-a", "r2") is None, what="the grace period to end"
        )
        assert _pin_of(running, "shared-a", "r1") == "gpu"


def test_a_pin_made_before_the_watcher_looks_still_moves_off_the_retired_revision(
    start, adapter_variants
):
    """A traffic change made elsewhere, then an admin pin of the name before the watcher's next
    look: the pin call recorded the new serving set without moving the pin off the revision that
    left, so it kept it for good."""

    def setup(registry):
        registry.pin("shared-a", tier="cpu")

    roots = (str(adapter_variants[0].parent),)
    with start(registry_setup=setup, allowed_roots=roots, registry_watch_s=3600) as running:
        # no watcher turn
        running.wait_for(
            lambda: _pin_of(running, "shared-a", "r1") == "cpu", what="r1 pinned at start"
        )
        body = {
            "name": "shared-a",
            "path": str(adapter_variants[4]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        running.registry.reading.grace_period = timedelta(0)  # no grace pin: r1 ends unpinned
        # the registry CLI, another process
        elsewhere = Registry(f"sqlite:///{running.tmp}/registry.db")
        elsewhere.promote("shared-a", "r2", force=True)
        elsewhere.close()
        assert (
            running.admin("POST", "/admin/adapters/shared-a/pin", json={"tier": "cpu"}).status_code
            == 200
        )
        running.server.follow_traffic()  # what the watcher does at its next look
        assert (_pin_of(running, "shared-a", "r2"), _pin_of(running, "shared-a", "r1")) == (
            "cpu",
            None,
        )


def test_an_operator_s_pin_of_one_revision_is_not_moved_by_traffic(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots, registry_watch_s=3600) as running:
        running.registry.reading.grace_period = timedelta(0)
        body = {
            "name": "shared-a",
            "path": str(adapter_variants[4]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        pinned = running.admin(
            "POST", "/admin/adapters/shared-a/pin", json={"tier": "cpu", "revision": "r1"}
        )
        assert pinned.status_code == 200, pinned.text
        running.wait_for(
            lambda: _pin_of(running, "shared-a", "r1") == "cpu", what="r1 pinned by the operator"
        )
        canary = running.admin(
            "PUT",
            "/admin/adapters/shared-a/traffic",
            json={"weights": {"r1": 90, "r2": 10}, "force": True},
        )
        assert canary.status_code == 200, canary.text
        promoted = running.admin(
            "POST", "/admin/adapters/shared-a/promote", json={"revision": "r2", "force": True}
        )
        assert promoted.status_code == 200, promoted.text
        # it left traffic; the operator's pin stays
        assert _pin_of(running, "shared-a", "r1") == "cpu"
        assert running.admin("POST", "/admin/adapters/shared-a/unpin").status_code == 200
        assert _pin_of(running, "shared-a", "r1") is None


def test_a_pin_or_unpin_made_by_another_process_reaches_the_running_server(start):
    """`registry pin` and `unpin` (the CLI, another process) reached a running server only with the
    name's next traffic change or the next start: the watcher follows a name's pin as it follows its
    traffic."""
    with start(registry_watch_s=0.1) as running:
        elsewhere = Registry(f"sqlite:///{running.tmp}/registry.db")
        elsewhere.pin("alice-a", tier="gpu")
        running.wait_for(
            lambda: (
                _pin_of(running, "alice-a", "r1") == "gpu" and _tier(running, "alice-a") == "gpu"
            ),
            what="alice-a pinned in a slot",
        )
        elsewhere.pin("alice-a", tier="cpu")
        running.wait_for(
            lambda: _pin_of(running, "alice-a", "r1") == "cpu", what="alice-a pinned in host memory"
        )
        elsewhere.unpin("alice-a")
        running.wait_for(lambda: _pin_of(running, "alice-a", "r1") is None, what="alice-a unpinned")
        assert _tier(running, "alice-a") in ("gpu", "cpu")  # unpinned, not evicted
        elsewhere.close()


def test_a_pin_of_one_revision_stays_on_it_and_an_unpin_elsewhere_releases_it(
    start, adapter_variants
):
    """An operator's pin of r1 in a canary split: the registry records a pin of the name (what a
    start pins again), which the watcher took for a pin of every serving revision (review: r2 pinned
    within 2 s). And `registry unpin` from another process left that revision pin in place for good,
    while the admin unpin releases it."""
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots, registry_watch_s=3600) as running:
        # the watcher's looks made here, in order
        body = {
            "name": "shared-a",
            "path": str(adapter_variants[4]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        canary = running.admin(
            "PUT",
            "/admin/adapters/shared-a/traffic",
            json={"weights": {"r1": 90, "r2": 10}, "force": True},
        )
        assert canary.status_code == 200, canary.text
        pinned = running.admin(
            "POST", "/admin/adapters/shared-a/pin", json={"tier": "cpu", "revision": "r1"}
        )
        assert pinned.status_code == 200, pinned.text
        running.server.follow_traffic()
        assert (_pin_of(running, "shared-a", "r1"), _pin_of(running, "shared-a", "r2")) == (
            "cpu",
            None,
        )
        elsewhere = Registry(f"sqlite:///{running.tmp}/registry.db")
        elsewhere.unpin("shared-a")
        elsewhere.close()
        running.server.follow_traffic()
        assert _pin_of(running, "shared-a", "r1") is None


def test_a_pin_moved_to_a_tier_that_refuses_it_leaves_no_pin_in_the_old_tier(start):
    """`registry pin --tier gpu`, then `--tier cpu` elsewhere, where the cpu pin cannot be made: the
    gpu pin goes too, since the registry no longer asks for it (and a start would not make it)."""
    with start(engine={"max_cpu_loras": 1}, registry_watch_s=3600) as running:
        # one host copy: no cpu pin fits
        elsewhere = Registry(f"sqlite:///{running.tmp}/registry.db")
        elsewhere.pin("alice-a", tier="gpu")
        running.server.follow_traffic()
        running.wait_for(
            lambda: _pin_of(running, "alice-a", "r1") == "gpu", what="alice-a pinned in gpu"
        )
        elsewhere.pin("alice-a", tier="cpu")
        elsewhere.close()
        running.server.follow_traffic()
        assert _pin_of(running, "alice-a", "r1") is None


def test_unpinning_a_warm_policy_lasts_past_traffic_changes(start, adapter_variants):
    """The admin unpin of an adapter whose manifest says warm gpu: the policy pinned it again at the
    next traffic change (and the next start). Unpinning ends the policy, in the registry too."""

    def register(registry):
        registry.add_revision(
            adapter_variants[0], "warm-gpu", shared=True, status="stable", warm_policy="gpu"
        )

    roots = (str(adapter_variants[0].parent),)
    with start(registry_setup=register, allowed_roots=roots, registry_watch_s=0.1) as running:
        running.registry.reading.grace_period = timedelta(0)
        running.wait_for(
            lambda: _pin_of(running, "warm-gpu", "r1") == "gpu",
            what="warm-gpu pinned by its policy",
        )
        assert running.admin("POST", "/admin/adapters/warm-gpu/unpin").status_code == 200
        assert _pin_of(running, "warm-gpu", "r1") is None
        assert running.registry.show("warm-gpu").warm_policy == "on_demand"
        body = {
            "name": "warm-gpu",
            "path": str(adapter_variants[1]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        promoted = running.admin(
            "POST", "/admin/adapters/warm-gpu/promote", json={"revision": "r2", "force": True}
        )
        assert promoted.status_code == 200, promoted.text
        running.client().completions.create(model="warm-gpu", prompt="x", max_tokens=1)
        running.server.follow_traffic()  # the watcher's look
        assert _pin_of(running, "warm-gpu", "r2") is None


def test_a_revision_rolled_back_into_service_gives_up_its_grace_pin(start, adapter_variants):
    """A revision that leaves traffic is pinned in host memory for the grace period; when a rollback
    puts it back into service it is kept by its traffic again, not held there until the period
    ends."""
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots, registry_watch_s=3600) as running:
        # r1 resident
        running.client().completions.create(model="shared-a", prompt="x", max_tokens=1)
        body = {
            "name": "shared-a",
            "path": str(adapter_variants[4]),
            "revision": "r2",
            "shared": True,
        }
        assert running.admin("POST", "/admin/adapters", json=body).status_code == 200
        promoted = running.admin(
            "POST", "/admin/adapters/shared-a/promote", json={"revision": "r2", "force": True}
        )
        assert promoted.status_code == 200, promoted.text
        # r2 resident
        running.client().completions.create(model="shared-a", prompt="x", max_tokens=1)
        assert _pin_of(running, "shared-a", "r1") == "cpu"  # its grace period
        assert running.admin("POST", "/admin/adapters/shared-a/rollback").status_code == 200
        assert (_pin_of(running, "shared-a", "r1"), _pin_of(running, "shared-a", "r2")) == (
            None,
            "cpu",
        )


def test_evict_in_flight_is_409(start):
    with start(engine={"max_model_len": 4096, "kv_cache_memory_bytes": 16 * 2**20}) as running:
        stream = running.client().completions.create(
            model="shared-a",
            prompt="x",
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        response = running.admin("POST", "/admin/adapters/shared-a/evict", json={})
        assert (
            response.status_code == 409 and response.json()["error"]["code"] == "adapter_in_flight"
        )
        stream.close()


def _entry(running, name):
    return next((a for a in running.state()["adapters"] if a["name"] == name), None)


def _tier(running, name):
    entry = _entry(running, name)
    return entry["tier"] if entry else None


def test_vllm_load_and_unload_with_drain(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots, engine={"max_model_len": 1024}) as running:
        outside = running.admin(
            "POST", "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}
        )
        assert outside.status_code == 400
        load = {"lora_name": "dyn", "lora_path": str(adapter_variants[1])}
        loaded = running.admin("POST", "/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        # already loaded
        assert running.admin("POST", "/v1/load_lora_adapter", json=load).status_code == 400
        for tenant in ("alice", "bob"):
            assert "dyn" in [m.id for m in running.client(tenant).models.list()]

        # A request in flight, then the unload: new requests get 404 at once, the old one finishes.
        stream = running.client().completions.create(
            model="dyn", prompt="x", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        unloaded = {}
        thread = threading.Thread(
            target=lambda: unloaded.update(
                r=running.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn"})
            )
        )
        thread.start()
        running.wait_for(
            lambda: "dyn" in running.server.resolver.draining, what="the drain to start"
        )
        with pytest.raises(openai.NotFoundError):
            running.client().completions.create(model="dyn", prompt="x", max_tokens=1)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        thread.join(60)
        assert unloaded["r"].status_code == 200, unloaded["r"].text
        assert "dyn" not in [m.id for m in running.client().models.list()]
        assert _entry(running, "dyn") is None
        revision = running.registry.show("dyn").revisions[0].revision
        with pytest.raises(openai.NotFoundError):  # gone by revision too, as vLLM's unload means
            running.client().completions.create(model=f"dyn@{revision}", prompt="x", max_tokens=1)
        assert _entry(running, "dyn") is None
        again = running.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": "dyn"})
        assert again.status_code == 404
        # loads again
        assert running.admin("POST", "/v1/load_lora_adapter", json=load).status_code == 200
        assert (
            running.client()
            .completions.create(model="dyn", prompt="x", max_tokens=1)
            .usage.completion_tokens
            == 1
        )


def test_admin_api_on_its_own_port(start):
    with start(admin_on_main_app=False) as running:
        assert running.admin("GET", "/admin/state").status_code == 404
        with serving(create_admin_app(running.server)) as admin_url:
            state = httpx.get(
                f"{admin_url}/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            assert state.status_code == 200 and state.json()["base_model"] == MODEL
            assert httpx.get(f"{admin_url}/admin/state").status_code == 401


def test_corrupted_revision_is_quarantined_and_the_stable_keeps_serving(running, adapter_variants):
    """A canary whose stored bytes are damaged fails its load once, is quarantined, and never served
    again."""
    registry = running.registry
    good, other = adapter_variants[18], adapter_variants[19]
    registry.add_revision(good, "fragile", revision="r1", shared=True, status="stable")
    bad = registry.add_revision(other, "fragile", revision="r2", shared=True)
    registry.promote("fragile", "r2", 100, force=True)
    weights = registry.store.path(bad.digest) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    client = running.client("alice")
    import openai

    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="fragile", prompt="hello", max_tokens=2)
    assert err.value.status_code == 503
    running.wait_for(
        lambda: registry.get_revision("fragile", "r2").status == "quarantined", what="quarantine"
    )
    for _ in range(3):
        response = client.completions.with_raw_response.create(
            model="fragile", prompt="hello", max_tokens=2
        )
        assert response.headers["x-loraplex-adapter"] == "fragile@r1"
    with pytest.raises(openai.NotFoundError) as gone:
        client.completions.create(model="fragile@r2", prompt="hello", max_tokens=2)
    # The reason tenants read names no path or URL of the store (the error with them is in the
    # server log).
    assert "failed their digest check" in gone.value.message
    assert (
        str(registry.store.root) not in gone.value.message and "sha256/" not in gone.value.message
    )


def test_a_failed_digest_check_is_quarantined_off_the_step_thread(start, adapter_variants):
    """The step reports the failed load; the registry write runs on the server's registry writer,
    and no registry call runs on the engine's step thread."""
    threads: dict[str, set[str]] = {}

    def corrupt(registry):
        record = registry.add_revision(
            adapter_variants[17], "brittle", shared=True, status="stable"
        )
        weights = registry.store.path(record.digest) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
        for name in dir(registry):
            method = getattr(registry, name)
            if not name.startswith("_") and callable(method):
                setattr(registry, name, recorded(name, method))

    def recorded(name, method):
        def call(*args, **kwargs):
            threads.setdefault(name, set()).add(threading.current_thread().name)
            return method(*args, **kwargs)

        return call

    with start(registry_setup=corrupt) as running:
        with pytest.raises(openai.InternalServerError) as failed:
            running.client().completions.create(model="brittle", prompt="x", max_tokens=2)
        assert failed.value.status_code == 503
        running.wait_for(
            lambda: running.registry.show("brittle").revisions[0].status == "quarantined",
            what="quarantine",
        )
    assert {name.rsplit("_", 1)[0] for name in threads["quarantine"]} == {"registry-write"}
    assert not [name for name, seen in threads.items() if "engine-loop" in seen]


def test_a_cpu_pin_the_budget_cannot_hold_is_refused_once_its_size_is_known(start):
    """An adapter never loaded has no known size, so the pin waits for its load and answers then:
    409, the pin undone, the registry not marked; the adapter still serves."""
    with start(engine={"cpu_cache_bytes": 1}) as running:
        response = running.admin("POST", "/admin/adapters/alice-a/pin", json={"tier": "cpu"})
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["code"] == "capacity_exceeded" and "cpu_cache_bytes" in error["message"]
        assert _entry(running, "alice-a")["pinned"] is None
        assert not running.registry.show("alice-a").pinned
        done = running.client().completions.create(model="alice-a", prompt="x", max_tokens=2)
        assert done.choices[0].text is not None


def test_a_cpu_pin_that_fits_answers_after_its_load(running):
    response = running.admin("POST", "/admin/adapters/bob-a/pin", json={"tier": "cpu"})
    assert response.status_code == 200, response.text
    assert response.json()["loading"] == []
    assert _entry(running, "bob-a")["pinned"] == "cpu" and _tier(running, "bob-a") in ("cpu", "gpu")
    assert running.admin("POST", "/admin/adapters/bob-a/unpin").status_code == 200


def test_pins_that_fail_leave_nothing_pinned_and_evict_unpins(start, adapter_variants):
    """A gpu pin of a name with two revisions in traffic, where only one gpu pin fits: 409 and
    neither stays pinned (the first did, holding the only pin). A cpu pin whose load fails: 503, not
    200 with nothing loaded. An evicted pinned adapter is unpinned in the registry too (the next
    start would pin it again)."""

    def register(registry):
        registry.add_revision(
            adapter_variants[4], "two", revision="r1", shared=True, status="stable"
        )
        registry.add_revision(adapter_variants[5], "two", revision="r2", shared=True)
        registry.promote("two", "r2", 50, force=True)
        record = registry.add_revision(adapter_variants[6], "frag", shared=True, status="stable")
        weights = registry.store.path(record.digest) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))

    with start(registry_setup=register) as running:  # 2 slots: one gpu pin at most
        refused = running.admin("POST", "/admin/adapters/two/pin", json={"tier": "gpu"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "capacity_exceeded"
        assert [e["pinned"] for e in running.state()["adapters"] if e["name"] == "two"] in (
            [None],
            [None, None],
        )
        assert not running.registry.show("two").pinned
        assert (
            running.admin("POST", "/admin/adapters/alice-a/pin", json={"tier": "gpu"}).status_code
            == 200
        )

        failed = running.admin("POST", "/admin/adapters/frag/pin", json={"tier": "cpu"})
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "adapter_unavailable"
        assert (
            _entry(running, "frag")["pinned"] is None and not running.registry.show("frag").pinned
        )

        assert running.registry.show("alice-a").pinned
        assert running.admin("POST", "/admin/adapters/alice-a/evict", json={}).status_code == 200
        assert (
            _entry(running, "alice-a")["pinned"] is None
            and not running.registry.show("alice-a").pinned
        )
