"""The capacity planner: sizes by the formula and on disk, what fits, the smallest cache for a
workload."""

import pytest

from loraplex.registry import Registry
from loraplex.sim import plan as planner
from loraplex.sim.workload import Request, write_trace


def test_sizes_by_formula_match_the_tensors(llama_dir, llama_adapters):
    adapters = planner.from_folder(
        next(iter(llama_adapters.values())).parent, planner.ModelConfig.from_dir(llama_dir), 4
    )
    assert {a.name for a in adapters} == set(llama_adapters)
    for a in adapters:
        # float32 stored, float32 served
        assert a.estimated_bytes == a.actual_bytes == a.serving_bytes
        assert a.file_bytes > a.actual_bytes  # header and config on top
    by_name = {a.name: a for a in adapters}
    # attn-r8 on the tiny Llama (hidden 64, 4 heads of 16, 2 kv heads): q, k, v, o over 2 layers,
    # float32
    per_layer = (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)
    assert by_name["attn-r8"].estimated_bytes == 2 * per_layer * 8 * 4


def test_plan_from_a_registry(llama_dir, llama_adapters, tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url, base_model_dir=llama_dir)
    registry.init()
    for name in ("attn-r8", "mlp-r4"):
        registry.add_revision(llama_adapters[name], name, base_model_dir=llama_dir, status="stable")
    registry.close()
    plan = planner.make_plan(llama_dir, registry=url)
    assert sorted((a.name, a.rank) for a in plan.adapters) == [("attn-r8", 8), ("mlp-r4", 4)]
    assert all(a.estimated_bytes > 0 and a.file_bytes is None for a in plan.adapters)
    # plan only reads: a missing registry is named, never made
    with pytest.raises(planner.PlanError, match="--registry: no registry at"):
        planner.make_plan(llama_dir, registry=f"sqlite:///{tmp_path / 'empty.db'}")
    assert not (tmp_path / "empty.db").exists()
    # A bare path, a file that is no database: one line (PlanError), not a traceback.
    not_a_db = tmp_path / "not-a-db"
    not_a_db.write_text("not a database")
    for bad, why in (
        (str(tmp_path / "registry.db"), "unsupported registry URL"),
        (f"sqlite:///{not_a_db}", "cannot open the registry"),
    ):
        with pytest.raises(planner.PlanError, match=f"--registry: {why}"):
            planner.make_plan(llama_dir, registry=bad)


def test_a_file_storing_a_and_b_in_two_dtypes_is_sized_by_each(llama_dir, llama_adapters, tmp_path):
    """A in bfloat16 and B in float32: the formula took A's dtype for both, and the host copy
    (float32 served) came out at half its size."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "adapters"
    mixed = folder / "mixed"
    shutil.copytree(llama_adapters["attn-r8"], mixed)
    tensors = load_file(mixed / "adapter_model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16) if "lora_A" in k else v for k, v in tensors.items()},
        mixed / "adapter_model.safetensors",
    )
    (adapter,) = planner.from_folder(folder, planner.ModelConfig.from_dir(llama_dir), 4)
    stored = load_file(mixed / "adapter_model.safetensors")
    assert (
        adapter.estimated_bytes
        == adapter.actual_bytes
        == sum(t.numel() * t.element_size() for t in stored.values())
    )
    assert adapter.serving_bytes == sum(t.numel() for t in stored.values()) * 4


def test_the_smallest_size_is_found_where_the_rate_does_not_fall_at_every_step():
    """Slot misses of a Zipf trace went 17.1%, 5.7%, 2.7%, 3.7%, 0% over 1, 2, 4, 8, 12 slots: a
    bisection for 2.74% answered 12 where 4 meets it."""
    rates = {1: 0.171, 2: 0.057, 4: 0.027, 8: 0.037, 12: 0.0}
    assert planner._smallest(list(rates), lambda slots: rates[slots] <= 0.0274) == 4
    assert planner._smallest(list(rates), lambda slots: rates[slots] <= -1) is None


def test_what_fits_and_smallest_cache_for_a_workload(llama_dir, llama_adapters, tmp_path):
    # Ten warm adapters taking turns on 8 slots, and a few cold ones: no cache keeps cold starts
    # under 1% (18 compulsory misses in 408 requests); under 5% needs host memory for the warm set.
    trace = [Request(0.5 * i, "t", f"warm{i % 10}", 16, 4, rank=8) for i in range(400)]
    trace += [Request(0.5 * i + 0.25, "t", f"cold{i}", 16, 4, rank=8) for i in range(0, 400, 50)]
    write_trace(sorted(trace, key=lambda r: r.time), tmp_path / "trace.jsonl")
    folder = next(iter(llama_adapters.values())).parent
    plan = planner.make_plan(llama_dir, adapters_dir=folder, workload=str(tmp_path / "trace.jsonl"))
    config = planner.ModelConfig.from_dir(llama_dir)
    assert plan.slot_bytes == 2 * 64 * 4 * sum(
        sum(config.linear_shape(m)) for m in ("q_proj", "k_proj", "v_proj", "o_proj")
    ) + 2 * 64 * 4 * sum(sum(config.linear_shape(m)) for m in ("gate_proj", "up_proj", "down_proj"))
    cpu_1, cpu_5, slots = plan.sizing
    assert cpu_1["cpu_bytes"] is None and cpu_1["rate"] is None
    # why: 18 first requests in 408 are cold whatever the cache
    assert (
        "the first request of each of its 18 adapters is cold whatever the cache: 4.41%"
        in (cpu_1["why"])
    )
    assert "why" not in cpu_5 and "why" not in slots
    assert cpu_5["cpu_bytes"] > 0 and cpu_5["rate"] <= 0.05
    assert slots["gpu_slots"] is not None and slots["rate"] <= planner.SLOT_MISS_TARGET
    assert len(planner.tables(plan)) == 3
    assert planner.fits([3, 1, 2], 3) == 2


def test_plan_sizes_vllms_host_cache_in_adapters(llama_dir, llama_adapters, tmp_path):
    """`plan --engine vllm` runs the vLLM residency: the cpu cache it answers is a count of
    adapters (vLLM's --max-cpu-loras), the smallest of its grid whose simulation meets the target,
    and the simulator at that count agrees."""
    trace = [Request(0.5 * i, "t", f"warm{i % 10}", 16, 4, rank=8) for i in range(400)]
    trace += [Request(0.5 * i + 0.25, "t", f"cold{i}", 16, 4, rank=8) for i in range(0, 400, 50)]
    path = tmp_path / "trace.jsonl"
    write_trace(sorted(trace, key=lambda r: r.time), path)
    folder = next(iter(llama_adapters.values())).parent
    plan = planner.make_plan(llama_dir, adapters_dir=folder, workload=str(path), engine="vllm")
    cpu_1, cpu_5, slots = plan.sizing
    assert cpu_1["cpu_loras"] is None and "18 adapters is cold" in cpu_1["why"]
    assert "27 adapters" in cpu_1["why"]  # the largest tried: 18 asked for, and half again
    count = cpu_5["cpu_loras"]
    assert count is not None and cpu_5["rate"] <= 0.05
    base, _ = planner._sizing_base(plan, str(path), planner.load_workload(str(path)))
    assert base.engine == "vllm"
    run = planner.simulate(
        planner.load_workload(str(path)),
        planner.replace(base, max_cpu_loras=count),
        planner.policy_factory("score"),
    )
    assert planner.summarize(run)["cold_start_rate"] == cpu_5["rate"]
    assert slots["cpu_loras"] == count and slots["rate"] <= planner.SLOT_MISS_TARGET
    sizing = planner.tables(plan)[-1]
    assert "engine vllm" in sizing.title and f"{count} adapters" in sizing.columns[3]._cells


def test_plan_reads_pins_and_warm_policies_and_takes_capacities(
    llama_dir, llama_adapters, tmp_path
):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url, base_model_dir=llama_dir)
    registry.init()
    registry.add_revision(llama_adapters["attn-r8"], "pinned", status="stable")
    registry.add_revision(llama_adapters["mlp-r4"], "warm", status="stable", warm_policy="cpu")
    registry.add_revision(llama_adapters["regex-r4"], "cold", status="stable")
    registry.pin("pinned", True, "gpu")
    registry.close()
    plan = planner.make_plan(llama_dir, registry=url, max_loras=1, cpu_cache_bytes=2**20)
    kept_in = {a.name: a.kept_in for a in plan.adapters}
    assert kept_in == {"pinned": "gpu", "warm": "cpu", "cold": None}
    assert (plan.defaults.max_loras, plan.defaults.cpu_cache_bytes) == (1, 2**20)
    _, tiers = planner.tables(plan)
    kept = {row: tiers.columns[-1]._cells[i] for i, row in enumerate(tiers.columns[0]._cells)}
    host = sum(a.serving_bytes for a in plan.adapters if a.kept_in)
    assert kept["gpu slots"] == "1 slots" and kept["cpu"] == planner._size(host)
    with pytest.raises(planner.PlanError, match="max_loras 0: must be at least 1"):
        planner.make_plan(llama_dir, registry=url, max_loras=0)
