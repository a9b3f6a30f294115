"""Unsloth's and Axolotl's output directories (PEFT underneath), registered as a user finds them:
each is served with the logits and greedy tokens HF transformers + PEFT give, and an adapter
trained on Unsloth's 4-bit copy of the base is accepted with a warning."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch
from tinymodels import make_adapter

from loraplex.artifacts import ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.formats import read_import_record
from loraplex.lora_format import CONFIG_FILE, AdapterRejected
from loraplex.registry import Registry

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5]]
QUANTISED = "unsloth/llama-3-8b-bnb-4bit"


def unsloth_output(model_dir, out):
    """`model.save_pretrained("lora_model")` after Unsloth's `FastLanguageModel.get_peft_model`
    (unsloth/models/llama.py), which makes PEFT's LoraConfig with lora_dropout 0, bias "none",
    task_type CAUSAL_LM, use_rslora, modules_to_save None and loftq_config (PEFT's default {}),
    on the base loaded as `unsloth/…-bnb-4bit`; PEFT writes the pair and a model card."""
    make_adapter(
        model_dir,
        out,
        seed=5,
        r=16,
        lora_alpha=16,
        target_modules=ALL_LINEAR,
        lora_dropout=0.0,
        bias="none",
        use_rslora=True,
        modules_to_save=None,
        loftq_config={},
    )
    config = json.loads((out / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = QUANTISED
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def axolotl_output(model_dir, out):
    """An Axolotl run's output_dir with `lora_target_linear: true` and `lora_modules_to_save:
    [embed_tokens, lm_head]` (axolotl's load_lora in src/axolotl/loaders/adapter.py: target_modules
    is `list(set(...))` of every linear module's name but lm_head, in no set order; lora_dropout,
    fan_in_fan_out as configured), beside what the HF Trainer leaves there."""
    names = list(ALL_LINEAR)
    random.Random(3).shuffle(names)
    make_adapter(
        model_dir,
        out,
        seed=6,
        r=8,
        lora_alpha=16,
        target_modules=names,
        lora_dropout=0.05,
        fan_in_fan_out=False,
        modules_to_save=["embed_tokens", "lm_head"],
    )
    torch.save({"learning_rate": 2e-4}, out / "training_args.bin")
    (out / "README.md").write_text("---\nlibrary_name: peft\n---\n# axolotl\n")
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (out / "tokenizer.json").write_text("{}")
    (out / "checkpoint-10").mkdir()
    shutil.copy(out / "adapter_model.safetensors", out / "checkpoint-10")
    return out


@pytest.fixture(scope="module")
def world(llama_dir, tmp_path_factory):
    """(registry, engine, sources): the base is served from a directory named as the model the
    quantised copy was made from."""
    import transformers
    from peft import PeftModel

    root = tmp_path_factory.mktemp("trainer-outputs")
    base_dir = shutil.copytree(llama_dir, root / "llama-3-8b")
    sources = {
        "unsloth": unsloth_output(base_dir, root / "lora_model"),
        "axolotl": axolotl_output(base_dir, root / "axolotl-out"),
    }
    registry = Registry(
        f"sqlite:///{root}/registry.db",
        ArtifactStore(root / "store"),
        base_model_dir=base_dir,
        strict_base_model_name=True,
    )
    registry.init()
    engine = LLMEngine(
        EngineConfig(
            model_dir=base_dir,
            dtype="float32",
            max_loras=2,
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=16,
        )
    )
    references = {}
    for name, src in sources.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        references[name] = PeftModel.from_pretrained(base, src).eval()
    yield registry, engine, sources, references
    engine.close()
    registry.close()


def test_their_configs_are_the_ones_they_write(world):
    _, _, sources, _ = world
    unsloth = json.loads((sources["unsloth"] / CONFIG_FILE).read_text())
    assert unsloth["loftq_config"] == {} and unsloth["modules_to_save"] is None
    assert unsloth["use_rslora"] is True and unsloth["task_type"] == "CAUSAL_LM"
    axolotl = json.loads((sources["axolotl"] / CONFIG_FILE).read_text())
    assert sorted(axolotl["target_modules"]) == sorted(ALL_LINEAR)
    assert sorted(axolotl["modules_to_save"]) == ["embed_tokens", "lm_head"]


@pytest.mark.parametrize("name", ["unsloth", "axolotl"])
def test_the_output_directory_is_served_as_peft_serves_it(world, caplog, name):
    registry, engine, sources, references = world
    with caplog.at_level(logging.WARNING):
        revision = registry.add_revision(sources[name], name)
    stored = registry.store.path(revision.digest)
    quantised = [r.getMessage() for r in caplog.records if "quantised copy" in r.getMessage()]
    if name == "unsloth":
        assert len(quantised) == 1 and QUANTISED in quantised[0]
        assert read_import_record(stored) is None  # stored byte for byte
    else:
        assert not quantised
        assert read_import_record(stored).changes == ("left out training_args.bin (not read)",)
    ref = engine.adapter_ref(name, stored)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = references[name](torch.tensor([prompt])).logits[0]
            greedy = references[name].generate(input_ids=torch.tensor([prompt]), **kwargs)
        torch.testing.assert_close(engine.score([prompt], [ref])[0], expected, atol=1e-4, rtol=0)
        assert engine.generate([prompt], params, [ref])[0] == greedy[0, len(prompt) :].tolist()


def test_a_quantised_copy_of_another_model_is_still_another_model(world, tmp_path):
    registry, _, sources, _ = world
    src = shutil.copytree(sources["unsloth"], tmp_path / "other")
    config = json.loads((src / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "unsloth/mistral-7b-bnb-4bit"
    (src / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterRejected, match="trained on 'unsloth/mistral-7b-bnb-4bit', not on"):
        registry.add_revision(src, "other")
