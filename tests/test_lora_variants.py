"""The variants' checks on real PEFT adapters edited as a trainer's bug would leave them: each is
refused in one line naming the field, and the bytes a variant adds are counted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import VOCAB, make_adapter, make_model

from loraplex.formats import import_adapter
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected, read_adapter
from loraplex.model_config import ModelConfig

ADAPTERS = {
    "saved": dict(target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"]),
    "lm-head": dict(target_modules=["q_proj", "lm_head"]),
    "embed": dict(target_modules=["embed_tokens", "v_proj"]),
    "tokens": dict(target_modules=["q_proj"], trainable_token_indices=[3, 7]),
    "dora": dict(target_modules=["q_proj", "down_proj"], use_dora=True),
}
LM_HEAD = "base_model.model.lm_head.weight"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    model_dir = make_model(root / "model", "llama")
    adapters = {
        name: make_adapter(model_dir, root / name, seed=i, r=4, lora_alpha=8, **args)
        for i, (name, args) in enumerate(ADAPTERS.items())
    }
    return ModelConfig.from_dir(model_dir), adapters


def edited(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of an adapter, its tensors through `tensors(dict) -> dict`, its config through
    `config(dict) -> None`."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors(load_file(dst / WEIGHTS_FILE)), dst / WEIGHTS_FILE)
    if config is not None:
        data = json.loads((dst / CONFIG_FILE).read_text())
        config(data)
        (dst / CONFIG_FILE).write_text(json.dumps(data))
    return dst


def served(model: ModelConfig, src: Path, tmp_path: Path):
    """The spec of the adapter as registration reads it: imported, then validated."""
    return read_adapter(import_adapter(src, model, tmp_path / "canonical").path, model, 16)


def without(*ends: str):
    return lambda t: {k: v for k, v in t.items() if not k.endswith(ends)}


def change(key_end: str, make):
    return lambda t: {k: (make(v) if k.endswith(key_end) else v) for k, v in t.items()}


CASES = {
    "named but not stored": (
        "saved",
        dict(tensors=without("lm_head.weight")),
        "modules_to_save",
        r"the config names \['lm_head'\], but no full weights are stored",
    ),
    "stored but not named": (
        "saved",
        dict(config=lambda c: c.update(modules_to_save=["embed_tokens"])),
        "modules_to_save",
        "is a full lm_head weight, but the config's modules_to_save does not name lm_head",
    ),
    "full weight of another shape": (
        "saved",
        dict(tensors=change("lm_head.weight", lambda v: v[:100])),
        "shape",
        r"lm_head.weight is \[100, 64\]; the base's lm_head is \[512, 64\]",
    ),
    "a LoRA and full weights on one module": (
        "lm-head",
        dict(
            tensors=lambda t: {**t, LM_HEAD: torch.zeros(VOCAB, 64)},
            config=lambda c: c.update(modules_to_save=["lm_head"]),
        ),
        "modules_to_save",
        "lm_head carries both a LoRA and full weights",
    ),
    "token ids beyond the vocabulary": (
        "tokens",
        dict(config=lambda c: c.update(trainable_token_indices=[3, VOCAB])),
        "trainable_token_indices",
        "distinct and below the vocabulary size 512",
    ),
    "token ids without their rows": (
        "tokens",
        dict(tensors=without("trainable_tokens_delta")),
        "trainable_token_indices",
        "one is missing",
    ),
    "trainable tokens beside a LoRA on the embedding": (
        "embed",
        dict(
            tensors=lambda t: {
                **t,
                "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": (
                    torch.zeros(2, 64)
                ),
            },
            config=lambda c: c.update(trainable_token_indices=[3, 7]),
        ),
        "trainable_token_indices",
        "beside a LoRA or full weights on the embedding",
    ),
    "a magnitude without use_dora": (
        "dora",
        dict(config=lambda c: c.update(use_dora=False)),
        "use_dora",
        "has a DoRA magnitude vector, but the config does not say use_dora",
    ),
    "use_dora without a magnitude": (
        "dora",
        dict(tensors=without("down_proj.lora_magnitude_vector")),
        "use_dora",
        "layer 0 down_proj: DoRA needs the module's lora_magnitude_vector",
    ),
    "a magnitude of another shape": (
        "dora",
        dict(tensors=change("q_proj.lora_magnitude_vector", lambda v: v[:10])),
        "shape",
        r"the magnitude vector is \[10\], the base's output is \[64\]",
    ),
    "a resized vocabulary": (
        "lm-head",
        dict(
            tensors=lambda t: {
                **change("lm_head.lora_B.weight", lambda v: torch.cat([v, v[:8]]))(t),
                "base_model.model.lm_head.base_layer.weight": torch.zeros(VOCAB + 8, 64),
            }
        ),
        "shape",
        r"the adapter was trained on a resized vocabulary",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_variant_that_does_not_fit_is_refused_naming_the_field(made, tmp_path, case):
    model, adapters = made
    name, edits, field, message = CASES[case]
    src = edited(adapters[name], tmp_path / "edited", **edits)
    with pytest.raises(AdapterRejected, match=message) as info:
        served(model, src, tmp_path)
    assert info.value.field == field


def test_every_variant_is_read_and_its_bytes_counted(made, tmp_path):
    model, adapters = made
    vocab, hidden, q = model.vocab_size, model.hidden_size, 4 * (64 + 64)
    specs = {name: served(model, src, tmp_path / name) for name, src in adapters.items()}
    assert [f.module for f in specs["saved"].variants.full] == ["embed_tokens", "lm_head"]
    assert specs["saved"].estimated_bytes == (2 * vocab * hidden + 2 * q) * 4
    lm_head = specs["lm-head"].variants.head_loras[0]
    assert (lm_head.module, lm_head.rank, lm_head.scaling) == ("lm_head", 4, 2.0)
    assert specs["lm-head"].estimated_bytes == (4 * (hidden + vocab) + 2 * q) * 4
    assert specs["lm-head"].target_modules == ("lm_head", "q_proj")
    assert specs["embed"].variants.head_loras[0].module == "embed_tokens"
    tokens = specs["tokens"].variants.tokens
    assert tokens is not None and tokens.indices == (3, 7) and not tokens.tied
    assert specs["tokens"].estimated_bytes == (2 * hidden + 2 * q) * 4
    assert all(m.key_magnitude for m in specs["dora"].modules)
    # two layers of q_proj and down_proj, each with its magnitude [64]
    assert specs["dora"].elements == 2 * (q + 64 + 4 * (128 + 64) + 64)


STATE_DICT_NAMES = [
    (".lora_magnitude_vector", ".lora_magnitude_vector.default.weight"),
    (".lora_embedding_A", ".lora_embedding_A.default"),
    (".lora_embedding_B", ".lora_embedding_B.default"),
    (".trainable_tokens_delta", ".trainable_tokens_delta.default"),
    ("lm_head.weight", "lm_head.modules_to_save.default.weight"),
    ("embed_tokens.weight", "embed_tokens.modules_to_save.default.weight"),
]


def state_dict_name(key: str) -> str:
    """The key as a PEFT model's state dict has it (the adapter name `default` in it)."""
    for end, raw in STATE_DICT_NAMES:
        if key.endswith(end) and ".base_layer." not in key:
            return key.removesuffix(end) + raw
    return key


@pytest.mark.parametrize("name", ["saved", "embed", "tokens", "dora"])
def test_state_dict_names_import_as_save_pretrained_writes_them(made, tmp_path, name):
    model, adapters = made
    raw = edited(
        adapters[name],
        tmp_path / "raw",
        tensors=lambda t: {state_dict_name(k): v for k, v in t.items()},
    )
    assert load_file(raw / WEIGHTS_FILE).keys() != load_file(adapters[name] / WEIGHTS_FILE).keys()
    imported = import_adapter(raw, model, tmp_path / "canonical").path
    expected = import_adapter(adapters[name], model, tmp_path / "expected").path
    got, want = load_file(imported / WEIGHTS_FILE), load_file(expected / WEIGHTS_FILE)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (
        served(model, raw, tmp_path / "served").variants
        == served(model, adapters[name], tmp_path / "served-expected").variants
    )
