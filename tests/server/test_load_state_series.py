"""The load-state series' top K over plain cache state (no server): which adapters get a series."""

from __future__ import annotations

from loraplex.registry.traffic import gateway_model
from loraplex.server.metrics import load_state_series


def _adapter(name, tier, pinned=None, demand=0.0, ago=1.0):
    return {
        "name": name,
        "revision": "r1",
        "digest": f"sha256:{name}",
        "model": name,
        "tier": tier,
        "pinned": pinned,
        "demand_5m": demand,
        "last_access_s_ago": ago,
    }


def _series(adapters, k):
    live = {"cache": {"adapters": adapters}, "max_loras": 2}
    families = list(load_state_series(live, k, lambda a: len(a["name"])))
    loaded = [
        (s.labels["adapter_name"], s.labels["level"], s.labels["pinned"], s.labels["rank"])
        for s in families[0].samples
    ]
    return loaded, families[1].samples[0].value, families[2].samples[0].value


def test_slots_first_then_pinned_then_the_busiest_and_never_more_than_k():
    adapters = [
        _adapter("cold", "disk"),
        _adapter("busy", "cpu", demand=9.0),
        _adapter("pin", "cpu", pinned="cpu"),
        _adapter("slot", "gpu", ago=50.0),
        _adapter("idle", "cpu", demand=0.1),
        _adapter("far", "remote"),
    ]
    loaded, on_gpu, slots = _series(adapters, 3)
    assert loaded == [
        ("slot", "gpu", "false", "4"),
        ("pin", "cpu", "true", "3"),
        ("busy", "cpu", "false", "4"),
    ]
    assert (on_gpu, slots) == (1, 2)
    assert len(_series(adapters, 10)[0]) == 4  # disk and remote copies are not loaded


def test_a_split_names_each_revision_and_a_single_revision_by_its_name():
    assert gateway_model("sql", "r2", frozenset({"r1", "r2"})) == "sql@r2"
    assert gateway_model("sql", "r1", frozenset({"r1"})) == "sql"
    assert gateway_model("sql", "r0", frozenset({"r1"})) == "sql@r0"  # left traffic, still resident
    assert gateway_model("sql", "r1", None) == "sql"
