"""torchtune's and NeMo's own adapter layouts, imported: each registered adapter gives the logits
and greedy tokens HF transformers + PEFT give for the PEFT adapter its tensors were written from,
the conversion is recorded, and their pickles are refused in one line saying to export
safetensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from adapter_layouts import GROUPS, shared_a, to_nemo, to_torchtune
from tinymodels import make_adapter, make_model

from loraplex.artifacts import ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.formats import import_adapter, read_import_record
from loraplex.lora_format import CONFIG_FILE, AdapterRejected
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5]]


def peft_model(model_dir, adapter):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return base.eval() if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def world(request, tmp_path_factory):
    """(registry, engine, sources): name -> (exported directory, PEFT reference model). On Llama,
    torchtune keeps q's and k's rows in Meta's rotary order; on Qwen2, in HF's."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"exports-{kind}")
    model_dir = make_model(root / "model", kind)
    config = ModelConfig.from_dir(model_dir)
    heads, kv = config.num_heads, config.num_kv_heads
    plain = make_adapter(
        model_dir, root / "peft" / "tune", seed=1, r=8, lora_alpha=16, target_modules=ALL_LINEAR
    )
    head = make_adapter(
        model_dir,
        root / "peft" / "head",
        seed=2,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "lm_head"],
    )
    every = make_adapter(
        model_dir, root / "peft" / "every", seed=3, r=4, lora_alpha=12, target_modules=ALL_LINEAR
    )
    fusable = shared_a(every, root / "peft" / "fusable", GROUPS)
    dora = make_adapter(
        model_dir,
        root / "peft" / "dora",
        seed=4,
        r=4,
        lora_alpha=8,
        use_dora=True,
        target_modules=ALL_LINEAR,
    )
    meta = kind == "llama"
    exports = {
        "torchtune": (to_torchtune(plain, root / "tt", heads, kv, meta), plain),
        "torchtune-lm-head": (to_torchtune(head, root / "tt-head", heads, kv, meta), head),
        "torchtune-dora": (to_torchtune(dora, root / "tt-dora", heads, kv, meta), dora),
        "nemo": (to_nemo(fusable, root / "nemo", heads, kv, fused=True), fusable),
        "nemo-canonical": (to_nemo(every, root / "nemo-c", heads, kv, fused=False), every),
    }
    registry = Registry(
        f"sqlite:///{root}/registry.db", ArtifactStore(root / "store"), base_model_dir=model_dir
    )
    registry.init()
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            max_loras=len(exports),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=16,
        )
    )
    sources = {name: (src, peft_model(model_dir, ref)) for name, (src, ref) in exports.items()}
    sources[None] = (None, peft_model(model_dir, None))
    yield registry, engine, sources, config
    engine.close()
    registry.close()


@pytest.mark.parametrize(
    "name", ["torchtune", "torchtune-lm-head", "torchtune-dora", "nemo", "nemo-canonical"]
)
def test_an_export_is_served_as_peft_serves_the_adapter_it_was_written_from(world, name):
    registry, engine, sources, _ = world
    src, reference = sources[name]
    revision = registry.add_revision(src, name)
    ref = engine.adapter_ref(name, registry.store.path(revision.digest))
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
            base = sources[None][1](torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(engine.score([prompt], [ref])[0], expected, atol=1e-4, rtol=0)
        assert (expected - base).abs().max() > 1e-2, "the adapter changes the output"
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        greedy = reference.generate(input_ids=torch.tensor([prompt]), **kwargs)[0, len(prompt) :]
        assert engine.generate([prompt], params, [ref])[0] == greedy.tolist()


@pytest.mark.parametrize(
    "name, source_format, change",
    [
        ("torchtune", "torchtune", "keys: torchtune names"),
        ("torchtune-dora", "torchtune", "DoRA: 14 magnitudes (torchtune's `magnitude`)"),
        ("nemo", "nemo", "keys: NeMo names"),
        ("nemo", "nemo", "config: peft.lora_tuning adapter_dim 4, alpha 12"),
        ("nemo", "nemo", "qkv_proj split into q_proj, k_proj, v_proj"),
    ],
)
def test_the_conversion_is_recorded(world, tmp_path, name, source_format, change):
    _, _, sources, config = world
    record = import_adapter(sources[name][0], config, tmp_path / "out").record
    assert record is not None and record.source_format == source_format
    assert any(change in c for c in record.changes), record.changes
    assert read_import_record(tmp_path / "out") == record


def test_rotary_rows_are_reordered_for_a_llama_only(world, tmp_path):
    _, _, sources, config = world
    changes = import_adapter(sources["torchtune"][0], config, tmp_path / "out").record.changes
    reordered = [c for c in changes if "Meta's rotary order" in c]
    assert reordered == (
        ["weights: rows of 4 q_proj and k_proj B's from Meta's rotary order to HF's"]
        if config.model_type == "llama"
        else []
    )
    dora = sources["torchtune-dora"][0]
    changes = import_adapter(dora, config, tmp_path / "dora").record.changes
    assert (
        "weights: rows of 4 q_proj and k_proj DoRA magnitudes from Meta's rotary order to HF's"
        in changes
    ) == (config.model_type == "llama")


def test_nemo_query_groups_that_are_not_the_base_s_are_refused(world, tmp_path):
    _, _, sources, config = world
    src = shutil.copytree(sources["nemo"][0], tmp_path / "nemo")
    text = (src / "model_config.yaml").read_text()
    (src / "model_config.yaml").write_text(
        text.replace("num_query_groups: 2", "num_query_groups: 4")
    )
    with pytest.raises(AdapterRejected, match="query groups and kv channels .* are not the base's"):
        import_adapter(src, config, tmp_path / "out")


@pytest.mark.parametrize(
    "files, found",
    [
        ({"adapter_0.pt": b"x", CONFIG_FILE: b"{}"}, "found adapter_0.pt (a PyTorch pickle"),
        (
            {"model_weights.ckpt": b"x", "model_config.yaml": b"peft: {}"},
            "found model_weights.ckpt",
        ),
        (
            {"lora.nemo": b"x"},
            "found lora.nemo (a NeMo archive; its model_weights.ckpt is a pickle)",
        ),
    ],
)
def test_their_pickles_are_refused_in_one_line_saying_to_export_safetensors(
    world, tmp_path, files, found
):
    for file, data in files.items():
        (tmp_path / file).write_bytes(data)
    with pytest.raises(AdapterRejected) as refused:
        import_adapter(tmp_path, world[3], tmp_path / "out")
    line = str(refused.value)
    assert found in line and "export the weights as safetensors" in line and "\n" not in line


def test_a_torchtune_config_without_alpha_is_refused(world, tmp_path):
    _, _, sources, config = world
    src = shutil.copytree(sources["torchtune"][0], tmp_path / "tt")
    tune = json.loads((src / CONFIG_FILE).read_text())
    del tune["lora_alpha"]
    (src / CONFIG_FILE).write_text(json.dumps(tune))
    with pytest.raises(AdapterRejected, match="torchtune adapter has no lora_alpha"):
        import_adapter(src, config, tmp_path / "out")
