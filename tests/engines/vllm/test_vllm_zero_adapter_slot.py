"""`--base-as-zero-adapter auto` takes vLLM a slot and a host cache place beyond `--max-loras` only
where the zero adapter may run: on the CPU backend without loraplex's fix to its mixed batches. A
GPU never carries it, so it never pays for it. The GPU is the one part faked here (vLLM's platform
says it is not the CPU); the configuration is vLLM's own, built from a tiny local model."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from loraplex.engines.vllm import engine as vllm_engine  # noqa: E402
from loraplex.engines.vllm.engine import VllmConfig, VllmEngine  # noqa: E402


def _vllm_slots(model_dir, tmp_path, mode: str) -> tuple[int, int]:
    """(max_loras, max_cpu_loras) of the vLLM configuration `serve --engine vllm` would start."""
    engine = VllmEngine.__new__(VllmEngine)  # the configuration only: nothing starts
    engine.config = VllmConfig(
        model_dir=model_dir,
        served_model_name="tiny",
        data_dir=tmp_path,
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=8,
        dtype="float32",
        max_model_len=128,
        base_as_zero_adapter=mode,
    )
    _, config = engine._vllm_config()
    return config.lora_config.max_loras, config.lora_config.max_cpu_loras


def test_auto_takes_an_extra_slot_only_on_a_cpu_without_the_fix(llama_dir, tmp_path, monkeypatch):
    # this machine: the CPU backend with loraplex's plugin, which fixes its mixed batches
    assert not vllm_engine._may_carry_zero_adapter("auto")
    assert _vllm_slots(llama_dir, tmp_path, "auto") == (2, 4)
    assert _vllm_slots(llama_dir, tmp_path, "on") == (3, 5)  # on: the zero adapter's own slot
    monkeypatch.setenv("VLLM_PLUGINS", "")  # the plugin left out: the CPU backend needs it
    assert vllm_engine._may_carry_zero_adapter("auto")
    assert _vllm_slots(llama_dir, tmp_path, "auto") == (3, 5)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)  # a GPU, fix or not
    assert not vllm_engine._may_carry_zero_adapter("auto")
    assert vllm_engine._may_carry_zero_adapter("on")
    assert not vllm_engine._may_carry_zero_adapter("off")
