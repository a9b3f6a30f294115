"""The router reads loraplex workers' state and vLLM workers' metrics."""

from loraplex.router.fleet import Worker

VLLM_METRICS = """
# HELP vllm:lora_requests_info Running stats on lora requests.
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",\
waiting_lora_adapters="math"} 1.7e9
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_running{model_name="m"} 5.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
"""


def test_vllm_worker_is_read_from_its_metrics():
    worker = Worker("http://w")
    worker.apply_vllm_metrics(VLLM_METRICS)
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert (view.waiting, view.running, view.kv_usage, view.free_slots) == (3, 5, 0.42, 2)
    assert view.gpu == {"sql", "chat"} and view.loading == {"math"} and worker.kind == "vllm"
    assert view.affinity("sql") == "gpu" and view.affinity("math") == "loading"


def test_loraplex_state_gives_residency_by_name_and_revision():
    worker = Worker("http://w")
    worker.apply_state(
        {
            "adapters": [
                {"name": "a", "revision": "r1", "tier": "gpu", "loading": False},
                {"name": "b", "revision": "r2", "tier": "cpu", "loading": False},
                {"name": "c", "revision": "r1", "tier": "remote", "loading": True},
            ],
            "load": {
                "waiting": 1,
                "running": 2,
                "active_tokens": 30,
                "kv_cache_usage": 0.1,
                "free_slots": 0,
            },
        }
    )
    worker.in_flight = 4
    view = worker.view(now=worker.polled_at + 1, stale_after_s=2)
    assert view.affinity("a") == view.affinity("a@r1") == "gpu" and view.affinity("b@r2") == "cpu"
    assert view.affinity("c") == "loading" and view.affinity("zzz") == "none"
    # four open at the router: the three the worker counts and one more
    assert view.load == 4 and view.in_flight == 1
    worker.in_flight = 2  # fewer than the worker counts (another router's too): its count stands
    assert worker.view(now=worker.polled_at + 1, stale_after_s=2).load == 1 + 2
    assert not worker.view(now=worker.polled_at + 5, stale_after_s=2).fresh


def test_adapters_routed_since_the_last_poll_count_as_loading_there():
    worker = Worker("http://w")
    worker.apply_state({"adapters": [], "load": {"free_slots": 0}})
    worker.sent.add("fresh-one")
    assert worker.view(now=worker.polled_at, stale_after_s=2).affinity("fresh-one") == "loading"
    assert worker.view(now=worker.polled_at, stale_after_s=2).affinity("other") == "none"


def test_vllm_s_newest_lora_series_is_the_current_one_and_engines_add_up():
    """vLLM keeps one lora_requests_info series per label set, valued at the time it was current;
    old ones stay."""
    text = """
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat,code,math,sql",\
waiting_lora_adapters=""} 1.5e9
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
"""
    worker = Worker("http://w")
    worker.apply_vllm_metrics(text)
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert view.gpu == {"sql"} and view.free_slots == 3
    assert (view.waiting, view.running) == (3, 7)


def routing_row(name: str, revision: str, tier: str, loading: bool = False) -> dict:
    return {
        "id": f"{name}@{revision}/sha256:{name}{revision}",
        "name": name,
        "revision": revision,
        "model": f"{name}@{revision}",
        "tier": tier,
        "loading": loading,
    }


def test_routing_deltas_update_the_index_by_name_and_revision():
    worker = Worker("http://w")
    load = {"waiting": 0, "running": 0, "free_slots": 0}
    worker.apply_routing(
        {
            "generation": "e.1",
            "reset": True,
            "load": load,
            "adapters": [routing_row("sql", "r1", "gpu"), routing_row("sql", "r2", "gpu")],
            "removed": [],
        }
    )
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert view.affinity("sql") == view.affinity("sql@r2") == "gpu"
    # r2 leaves the worker: the name stays in the slots with r1
    delta = {"reset": False, "load": load, "removed": ["sql@r2/sha256:sqlr2"]}
    worker.apply_routing({**delta, "generation": "e.2"})
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert (view.affinity("sql"), view.affinity("sql@r2")) == ("gpu", "none")
    # r1 leaves the slots for host memory, loading back
    row = routing_row("sql", "r1", "cpu", loading=True)
    worker.apply_routing({"generation": "e.3", "reset": False, "load": load, "adapters": [row]})
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert (view.affinity("sql"), view.affinity("sql@r1")) == ("cpu", "cpu")
    assert set(view.gpu) == set() and "sql@r1" in view.loading and worker.generation == "e.3"
    # a reset starts over from the rows it carries
    worker.apply_routing({"generation": "f.1", "reset": True, "load": load, "adapters": []})
    assert worker.view(now=worker.polled_at, stale_after_s=2).affinity("sql") == "none"


def test_a_worker_is_full_at_its_capacity_of_the_router_s_open_requests():
    """The worker runs 4 (`max_num_seqs`), none waiting, at the last poll: full while the router
    has 4 open there (plus the queue limit); a finished one frees a place at once, whatever the
    poll said."""
    worker = Worker("http://w")
    worker.apply_state({"adapters": [], "load": {"running": 4, "max_num_seqs": 4}})
    worker.in_flight = 4
    view = worker.view(now=worker.polled_at, stale_after_s=2)
    assert (view.capacity, view.num_open, view.full(0), view.full(1), view.full(-1)) == (
        4,
        4,
        True,
        False,
        False,
    )
    worker.in_flight, worker.finished = 3, 1
    assert not worker.view(now=worker.polled_at, stale_after_s=2).full(0)
    worker.apply_state({"adapters": [], "load": {"running": 4}})  # no capacity reported
    worker.in_flight = 9
    assert not worker.view(now=worker.polled_at, stale_after_s=2).full(0)
