"""Adapters in other layouts, registered: their canonical form gives the logits HF transformers +
PEFT give for the adapter they were made from, and the conversion is recorded; formats we do not
read are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from adapter_layouts import GROUPS, PREFIX, fused, shared_a, to_mlx, without_prefix
from safetensors.torch import load_file, save_file
from tinymodels import peft_reference, reference_logits

from loraplex.artifacts import ArtifactStore, canonical_digest
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.formats import import_adapter, read_import_record
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def world(llama_dir, llama_adapters, tmp_path_factory):
    """(registry, engine, PEFT reference, sources): each source name -> (its directory, the PEFT
    adapter it was made from)."""
    root = tmp_path_factory.mktemp("formats")
    adapters = dict(llama_adapters)
    adapters["shared-a"] = shared_a(adapters["all-r16-rslora"], root / "shared-a", GROUPS)
    mlx = to_mlx(adapters["mlp-r4"], root / "mlx-mlp-r4")
    # MLX-LM's checkpoints, saved beside the adapter during training
    shutil.copy(mlx / "adapters.safetensors", mlx / "0000100_adapters.safetensors")
    sources = {
        "mlx-mlp-r4": (mlx, "mlp-r4"),
        "mlx-rslora": (to_mlx(adapters["all-r16-rslora"], root / "mlx-rslora"), "all-r16-rslora"),
        "no-prefix-pattern": (
            without_prefix(adapters["pattern"], root / "no-prefix-pattern"),
            "pattern",
        ),
        "fused-qkv-gate-up": (fused(adapters["shared-a"], root / "fused", GROUPS), "shared-a"),
        "peft": (adapters["attn-r8"], "attn-r8"),
    }
    registry = Registry(
        f"sqlite:///{root}/registry.db",
        ArtifactStore(root / "store"),
        base_model_dir=llama_dir,
        max_lora_rank=16,
    )
    registry.init()
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=len(sources),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=16,
        )
    )
    used = {origin for _, origin in sources.values()}
    reference = peft_reference(llama_dir, {n: p for n, p in adapters.items() if n in used})
    yield registry, engine, reference, sources
    engine.close()
    registry.close()


@pytest.fixture(scope="module")
def registered(world):
    """Each source registered: name -> its stored (canonical) directory and revision."""
    registry, _, _, sources = world
    out = {}
    for name, (src, _) in sources.items():
        record = registry.add_revision(src, name)
        out[name] = (registry.store.path(record.digest), record)
    return out


@pytest.mark.parametrize(
    "name", ["mlx-mlp-r4", "mlx-rslora", "no-prefix-pattern", "fused-qkv-gate-up", "peft"]
)
def test_registered_adapter_gives_the_logits_of_the_peft_adapter_it_was_made_from(
    world, registered, name
):
    _, engine, reference, sources = world
    stored, _ = registered[name]
    ref = engine.adapter_ref(name, stored)
    logits = engine.score([PROMPT], [ref])[0]
    expected = reference_logits(reference, PROMPT, sources[name][1])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # the adapter changes the output, so the comparison has teeth
    assert (logits - reference_logits(reference, PROMPT, None)).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["mlx-rslora", "no-prefix-pattern", "fused-qkv-gate-up"])
def test_canonical_form_loads_in_peft_itself_with_the_same_logits(
    world, registered, llama_dir, name
):
    _, _, reference, sources = world
    stored, _ = registered[name]
    canonical = peft_reference(llama_dir, {"canonical": stored})
    torch.testing.assert_close(
        reference_logits(canonical, PROMPT, "canonical"),
        reference_logits(reference, PROMPT, sources[name][1]),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize(
    "name, source_format, change",
    [
        ("mlx-mlp-r4", "mlx-lm", "A and B transposed"),
        ("mlx-mlp-r4", "mlx-lm", "left out 0000100_adapters.safetensors (not read)"),
        ("no-prefix-pattern", "peft", "added the base_model.model. prefix to 6 tensors"),
        ("no-prefix-pattern", "peft", "dropped the adapter name .default from 6 tensors"),
        ("fused-qkv-gate-up", "peft", "qkv_proj split into q_proj, k_proj, v_proj"),
        ("fused-qkv-gate-up", "peft", "gate_up_proj split into gate_proj, up_proj"),
    ],
)
def test_conversion_is_recorded_in_the_artifact_and_the_audit_log(
    world, registered, name, source_format, change
):
    registry, _, _, sources = world
    stored, revision = registered[name]
    record = read_import_record(stored)
    assert record is not None and record.source_format == source_format
    assert record.source_digest == canonical_digest(sources[name][0])
    assert record.source_digest != revision.digest == canonical_digest(stored)
    assert any(change in c for c in record.changes), record.changes
    (added,) = [e for e in registry.audit_events(target=name) if e.action == "add"]
    assert added.detail["imported"] == record.as_dict()


def test_a_canonical_peft_adapter_is_stored_byte_for_byte(world, registered):
    registry, _, _, sources = world
    stored, revision = registered["peft"]
    assert revision.digest == canonical_digest(sources["peft"][0])
    assert read_import_record(stored) is None
    (added,) = [e for e in registry.audit_events(target="peft") if e.action == "add"]
    assert "imported" not in added.detail


def test_an_unsloth_output_directory_is_stored_as_it_is(world, llama_adapters, tmp_path):
    """Unsloth saves the PEFT pair and a model card, its config naming Unsloth's copy of the base
    (a warning only: the shapes are checked)."""
    registry = world[0]
    src = shutil.copytree(llama_adapters["mlp-r4"], tmp_path / "lora_model")
    config = json.loads((src / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "unsloth/llama-3-8b-bnb-4bit"
    (src / CONFIG_FILE).write_text(json.dumps(config))
    (src / "README.md").write_text("# model card\n")
    record = registry.add_revision(src, "unsloth")
    assert record.digest == canonical_digest(src)
    assert read_import_record(registry.store.path(record.digest)) is None


def test_an_axolotl_output_directory_loads_leaving_out_its_trainer_state(
    world, llama_adapters, tmp_path
):
    """As Axolotl (the HF Trainer) leaves it: the pickled training arguments are never read, and
    the adapter's tensors are stored as they are."""
    registry = world[0]
    src = shutil.copytree(llama_adapters["mlp-r4"], tmp_path / "axolotl-out")
    torch.save({"lr": 1e-4}, src / "training_args.bin")
    (src / "README.md").write_text("# model card\n")
    (src / "tokenizer.json").write_text("{}")
    (src / "config.json").write_text("{}")
    (src / "checkpoint-10").mkdir()
    record = registry.add_revision(src, "axolotl")
    stored = registry.store.path(record.digest)
    assert read_import_record(stored).changes == ("left out training_args.bin (not read)",)
    expected = load_file(src / WEIGHTS_FILE)
    got = load_file(stored / WEIGHTS_FILE)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def test_a_torchtune_epoch_directory_loads_leaving_out_its_own_copy_of_the_weights(
    world, llama_adapters, tmp_path
):
    """torchtune's HF checkpointer writes the PEFT pair beside `adapter_model.pt` (the same weights
    under torchtune's names, pickled) and the base model's config and tokenizer files."""
    registry = world[0]
    src = shutil.copytree(llama_adapters["attn-r8"], tmp_path / "epoch_0")
    torch.save({"layers.0.attn.q_proj.lora_a.weight": torch.zeros(1)}, src / "adapter_model.pt")
    (src / "config.json").write_text("{}")
    record = registry.add_revision(src, "torchtune")
    stored = registry.store.path(record.digest)
    assert read_import_record(stored).changes == ("left out adapter_model.pt (not read)",)
    assert load_file(stored / WEIGHTS_FILE).keys() == load_file(src / WEIGHTS_FILE).keys()


def _unsupported(tmp_path: Path, llama_adapters) -> dict[str, tuple[Path, str]]:
    cases = {}

    def case(name: str, files: dict[str, bytes], message: str) -> None:
        d = tmp_path / name
        d.mkdir()
        for file, data in files.items():
            (d / file).write_bytes(data)
        cases[name] = (d, message)

    config = (llama_adapters["attn-r8"] / CONFIG_FILE).read_bytes()
    case(
        "pickle",
        {CONFIG_FILE: config, "adapter_model.bin": b"x"},
        "unsupported adapter format: found adapter_model.bin (a PyTorch pickle; loading one can "
        "run code); only safetensors are read",
    )
    case("torchtune", {"adapter_0.pt": b"x"}, "found adapter_0.pt (a PyTorch pickle")
    case("nemo", {"lora.nemo": b"x"}, "found lora.nemo (a NeMo archive")
    case("gguf", {"adapter.gguf": b"x"}, "found adapter.gguf (a GGUF file)")
    case("empty", {}, "holds neither adapter_model.safetensors (PEFT, torchtune) nor adapters")
    weights = (llama_adapters["attn-r8"] / WEIGHTS_FILE).read_bytes()
    case(
        "not-mlx",
        {CONFIG_FILE: config, "adapters.safetensors": weights},
        "adapters.safetensors with a adapter_config.json that has no lora_parameters",
    )
    return cases


@pytest.mark.parametrize("name", ["pickle", "torchtune", "nemo", "gguf", "empty", "not-mlx"])
def test_a_format_we_do_not_read_is_refused_in_one_line_naming_it(
    llama_dir, llama_adapters, tmp_path, name
):
    src, message = _unsupported(tmp_path, llama_adapters)[name]
    with pytest.raises(AdapterRejected) as refused:
        import_adapter(src, ModelConfig.from_dir(llama_dir), tmp_path / "out")
    assert refused.value.field == "format"
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_fused_b_that_does_not_fit_the_base_parts_is_refused(
    world, llama_dir, registered, tmp_path
):
    src = shutil.copytree(world[3]["fused-qkv-gate-up"][0], tmp_path / "short")
    tensors = load_file(src / WEIGHTS_FILE)
    key = next(k for k in tensors if "gate_up_proj.lora_B" in k)
    tensors[key] = tensors[key][:-1]
    save_file(tensors, src / WEIGHTS_FILE)
    with pytest.raises(
        AdapterRejected, match="B has 255 rows; the base's gate_proj, up_proj have 256"
    ):
        import_adapter(src, ModelConfig.from_dir(llama_dir), tmp_path / "out")


def test_mlx_bf16_tensors_are_transposed_bit_for_bit(llama_dir, llama_adapters, tmp_path):
    src = to_mlx(llama_adapters["mlp-r4"], tmp_path / "mlx")
    bf16 = {k: t.to(torch.bfloat16) for k, t in load_file(src / "adapters.safetensors").items()}
    save_file(bf16, src / "adapters.safetensors")
    out = import_adapter(src, ModelConfig.from_dir(llama_dir), tmp_path / "out").path
    got = load_file(out / WEIGHTS_FILE)
    for key, tensor in bf16.items():
        side = "A" if key.endswith("lora_a") else "B"
        canonical = PREFIX + key.rsplit(".", 1)[0] + f".lora_{side}.weight"
        assert torch.equal(got[canonical], tensor.T), key


def test_an_import_is_deterministic_and_put_back_after_a_gc_removed_it(world, registered):
    """The same source gives the same canonical bytes, so registering it again finds its revision,
    and a registration whose artifact a gc removed imports it again."""
    registry, _, _, sources = world
    src = sources["mlx-rslora"][0]
    _, revision = registered["mlx-rslora"]
    assert registry.add_revision(src, "mlx-rslora").revision == revision.revision
    stored = registry.registration.check_and_store(src, None, None, None, None, None)
    assert stored.digest == revision.digest
    registry.store.remove(stored.digest)
    registry.registration.put_again(stored)
    assert canonical_digest(registry.store.path(stored.digest)) == revision.digest


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "model.layers.0.self_attn.o_proj.lora_A.weight",
            "both give the tensor base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight",
        ),
        (
            "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight",
            "both give the tensor base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight",
        ),
    ],
)
def test_two_source_tensors_for_one_canonical_tensor_are_refused(
    world, llama_dir, tmp_path, extra, message
):
    """A prefix-less copy of a key, or a split module beside its fused one: which one PEFT would
    load is not for the import to guess."""
    src = shutil.copytree(world[3]["fused-qkv-gate-up"][0], tmp_path / "twice")
    tensors = load_file(src / WEIGHTS_FILE)
    tensors[extra] = torch.zeros_like(next(t for k, t in tensors.items() if "lora_A" in k))
    save_file(tensors, src / WEIGHTS_FILE)
    with pytest.raises(AdapterRejected, match=message):
        import_adapter(src, ModelConfig.from_dir(llama_dir), tmp_path / "out")
