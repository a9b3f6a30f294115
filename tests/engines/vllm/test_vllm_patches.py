"""loraplex's fixes for two vLLM LoRA bugs (loraplex.engines.vllm.patches): the ops against vLLM's
own torch ops as the oracle, the scheduler's budget, and the reproductions against vLLM alone
(vllm_bugs.py), which show each bug with the plugin left out and its absence with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vllm_serve

from loraplex.engines.vllm import patches

pytest.importorskip("vllm")
from vllm.lora.ops import torch_ops  # noqa: E402

SLOTS, T, D_IN, RANK, D_OUT = 3, 7, 16, 4, 12


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D_IN, generator=g)
    a = torch.randn(SLOTS, 1, RANK, D_IN, generator=g)  # lora_a stacked: [slots, 1, r, in]
    b = torch.randn(SLOTS, 1, D_OUT, RANK, generator=g)  # lora_b stacked: [slots, 1, out, r]
    h = torch.randn(T, RANK, generator=g)
    y = torch.randn(T, D_OUT, generator=g)
    return x, a, b, h, y


def test_ops_match_vllms_for_rows_with_a_lora():
    x, a, b, h, y = _data()
    idx = torch.tensor([2, 0, 0, 1, 2, 2, 1])
    ours, theirs = torch.zeros(T, RANK), torch.zeros(T, RANK)
    patches.bgmv_shrink(x, a, ours, idx, 0.5)
    torch_ops.bgmv_shrink(x, a, theirs, idx, 0.5)
    torch.testing.assert_close(ours, theirs)
    for add in (True, False):
        ours, theirs = y.clone(), y.clone()
        patches.bgmv_expand(h, b, ours, idx, add)
        torch_ops.bgmv_expand(h, b, theirs, idx, add)
        torch.testing.assert_close(ours, theirs)
        ours, theirs = torch.zeros(T, 20), torch.zeros(T, 20)
        patches.bgmv_expand_slice(h, b, ours, idx, 5, D_OUT, add)
        torch_ops.bgmv_expand_slice(h, b, theirs, idx, 5, D_OUT, add)
        torch.testing.assert_close(ours, theirs)


def test_sgmv_ops_match_vllms_per_segment():
    x, a, b, h, y = _data(1)
    seg_slots, seg_lens = torch.tensor([1, 0, 2]), torch.tensor([3, 2, 2])
    meta = (torch.tensor([0, 3, 5]), seg_lens, seg_slots, 3, 3, T)
    ours, theirs = torch.zeros(T, RANK), torch.zeros(T, RANK)
    patches.sgmv_shrink(x, a, ours, *meta, 2.0)
    torch_ops.sgmv_shrink(x, a, theirs, *meta, 2.0)
    torch.testing.assert_close(ours, theirs)
    ours, theirs = y.clone(), y.clone()
    patches.sgmv_expand(h, b, ours, *meta, True)
    torch_ops.sgmv_expand(h, b, theirs, *meta, True)
    torch.testing.assert_close(ours, theirs)


def test_rows_without_a_lora_take_nothing_where_vllms_ops_take_the_last_slot():
    x, a, b, h, y = _data(2)
    idx = torch.tensor([-1, 0, -1, 1, -1, 2, -1])
    base = idx < 0
    shrunk = torch.full((T, RANK), 9.0)
    patches.bgmv_shrink(x, a, shrunk, idx, 1.0)
    assert (shrunk[base] == 0).all() and (shrunk[~base] != 0).all()
    out = y.clone()
    patches.bgmv_expand(h, b, out, idx, True)
    torch.testing.assert_close(out[base], y[base])  # base rows: unchanged
    assert not torch.allclose(out[~base], y[~base])
    theirs = y.clone()
    torch_ops.bgmv_expand(h, b, theirs, idx, True)
    last = y.clone()
    torch_ops.bgmv_expand(h, b, last, torch.full_like(idx, SLOTS - 1), True)
    torch.testing.assert_close(theirs[base], last[base])  # the bug: -1 reads the last slot
    # the whole batch without a LoRA: nothing added at all
    out = y.clone()
    patches.sgmv_expand(
        h, b, out, torch.tensor([0]), torch.tensor([T]), torch.tensor([-1]), 1, T, T, True
    )
    torch.testing.assert_close(out, y)


def test_lora_budget_leaves_out_slots_of_pinned_adapters_outside_the_batch():
    assert patches.lora_budget(4, set(), set()) == 4
    assert patches.lora_budget(4, {7}, set()) == 3  # 7 holds a slot while idle
    assert patches.lora_budget(4, {7}, {7, 8}) == 4  # 7 runs: it counts once, in the batch
    assert patches.lora_budget(2, {7, 9}, set()) == 0
    assert patches.lora_budget(2, {7}, {8, 9}) == 2  # never below the adapters already running


def test_only_the_versions_read_are_patched():
    assert patches.affected("0.32.0") == {"no_lora_rows": True, "pinned_slots": True}
    assert not any(patches.affected("0.31.1").values())
    # vLLM 0.33 fixed its CPU ops itself; its scheduler and 0.34's still count no pins
    assert patches.affected("0.33.0") == {"no_lora_rows": False, "pinned_slots": True}
    assert patches.affected("0.34.1") == {"no_lora_rows": False, "pinned_slots": True}
    assert not any(patches.affected("0.35.0").values())


def test_a_bug_vllm_fixed_itself_is_handled_without_the_plugin(monkeypatch):
    import vllm

    assert patches.fixed_upstream("0.33.0") == {"no_lora_rows": True, "pinned_slots": False}
    assert not any(patches.fixed_upstream("0.32.0").values())
    monkeypatch.setenv("VLLM_PLUGINS", "")  # the plugin left out
    assert not patches.handled("no_lora_rows") and not patches.handled("pinned_slots")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")  # vLLM's own fix: no zero adapter needed
    assert patches.handled("no_lora_rows") and not patches.handled("pinned_slots")
    monkeypatch.delenv("VLLM_PLUGINS")
    assert patches.handled("pinned_slots") and not patches.applies("no_lora_rows")


@pytest.fixture(scope="module")
def bug_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-bugs")
    model, adapters = vllm_serve.make_world(
        root,
        {
            "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "b": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
            "c": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        },
    )
    return root, [model, adapters["a"], adapters["b"], adapters["c"]]


def _reproduce(root: Path, paths: list[Path], plugins: str | None) -> tuple[dict, str]:
    # the plugin's lines read below are INFO: whatever level this process's environment names
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    script, report = Path(__file__).with_name("vllm_bugs.py"), root / f"report-{plugins}.json"
    report.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(script), str(report), *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert report.is_file(), proc.stderr[-3000:]
    return json.loads(report.read_text()), proc.stdout + proc.stderr


def test_unpatched_vllm_shows_both_bugs(bug_world):
    report, log = _reproduce(*bug_world, plugins="")  # no plugin: vLLM as released
    alone, mixed = report["alone"], report["mixed_batch"]
    assert "loraplex:" not in log
    # the base row takes the adapter in the last slot (whose outputs it then is, once the slot
    # holds it from the first step); the adapter rows stay right
    assert not mixed["base_row_as_alone"] and mixed["adapter_rows_as_alone"]
    assert len({tuple(v) for v in alone.values()}) == 4
    assert report["pinned_slots"]["error"] is not None  # the worker fails; vLLM's engine dies


def test_patched_vllm_serves_mixed_batches_and_pinned_slots_right(bug_world):
    report, log = _reproduce(*bug_world, plugins=None)  # every plugin: loraplex's among them
    alone, mixed = report["alone"], report["mixed_batch"]
    assert "loraplex: CPU LoRA ops patched" in log
    assert "loraplex: the scheduler counts pinned LoRA slots" in log
    assert len({tuple(v) for v in alone.values()}) == 4  # the adapters change the outputs
    assert mixed["base_row_as_alone"] and mixed["adapter_rows_as_alone"]
    assert report["pinned_slots"] == {"as_alone": True, "error": None}


def test_applies_follows_vllm_plugins(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert patches.applies("no_lora_rows") and patches.applies("pinned_slots")
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert not patches.applies("no_lora_rows") and not patches.applies("pinned_slots")
    monkeypatch.setenv("VLLM_PLUGINS", "other,loraplex")
    assert patches.applies("pinned_slots")
