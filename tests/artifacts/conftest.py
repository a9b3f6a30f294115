"""Fixtures: a real PEFT adapter on the tiny Llama (tests/tinymodels.py)."""

from __future__ import annotations

import pytest
from tinymodels import make_adapter


@pytest.fixture(scope="session")
def adapter_v1(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifact-adapters")
    return make_adapter(
        llama_dir, root / "v1", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
