"""Every refusal at registration, with its message, on real PEFT adapters; a refusal leaves nothing
behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key
from safetensors.torch import load_file, save_file

from loraplex.artifacts import AllowList, ArtifactStore, canonical_digest
from loraplex.registry import AdapterRejected, Registry
from loraplex.registry.signing import generate_keypair, sign_digest


def rewrite_weights(src, dst, change):
    """Copy an adapter, passing its tensors through `change(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = change(load_file(dst / "adapter_model.safetensors"))
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def assert_refused(registry: Registry, src, field: str, message: str, **kwargs) -> None:
    with pytest.raises(AdapterRejected, match=message) as info:
        registry.add_revision(src, "chat", **kwargs)
    assert info.value.field == field
    assert registry.list_adapters() == []
    assert registry.audit_events() == []
    assert registry.store.digests() == []


@pytest.mark.parametrize(
    ("key", "lora_args", "field", "message"),
    [
        (
            "dora-lm-head",
            dict(target_modules=["q_proj", "lm_head"], use_dora=True),
            "use_dora",
            "DoRA on lm_head is not supported",
        ),
        ("bias", dict(bias="lora_only"), "bias", "bias='lora_only' is not supported; only 'none'"),
        (
            "modules-to-save",
            dict(modules_to_save=["norm"]),
            "modules_to_save",
            r"\['norm'\] is not supported; only full weights of lm_head and embed_tokens",
        ),
        ("lora-bias", dict(lora_bias=True), "lora_bias", "LoRA with a bias on B"),
        ("rank16", dict(r=16), "rank", "rank 16 of layer 0 q_proj is above max_lora_rank 8"),
        # weights like a plain LoRA's, another forward pass: PEFT applies an aLoRA only after its
        # invocation tokens, and a replicated stack runs the adapter on layers the base does not
        # have as such
        (
            "alora",
            dict(alora_invocation_tokens=[7, 8]),
            "alora_invocation_tokens",
            "activated LoRA .* not supported",
        ),
        (
            "replication",
            dict(layer_replication=[[0, 1], [0, 1]]),
            "layer_replication",
            "layer replication .* not supported",
        ),
    ],
)
def test_peft_features_we_do_not_serve_are_refused(
    sqlite_registry, adapter_factory, key, lora_args, field, message
):
    sqlite_registry.registration.max_lora_rank = 8
    assert_refused(sqlite_registry, adapter_factory(key, **lora_args), field, message)


def test_pickle_only_adapter_is_refused(sqlite_registry, adapter_v1, tmp_path):
    src = shutil.copytree(adapter_v1, tmp_path / "pickled")
    torch.save(load_file(src / "adapter_model.safetensors"), src / "adapter_model.bin")
    (src / "adapter_model.safetensors").unlink()
    assert_refused(
        sqlite_registry,
        src,
        "format",
        r"unsupported adapter format: found adapter_model.bin \(a PyTorch pickle; loading one can "
        r"run code\); only safetensors are read",
    )


def test_pickle_beside_safetensors_is_refused(sqlite_registry, adapter_v1, tmp_path):
    src = shutil.copytree(adapter_v1, tmp_path / "both")
    torch.save({}, src / "adapter_model.bin")
    assert_refused(sqlite_registry, src, "weights", "adapter_model.bin is a pickle file")


def test_shape_mismatch_is_refused(sqlite_registry, adapter_factory, wide_base_dir):
    src = adapter_factory("wide", base=wide_base_dir)
    message = (
        r"layer 0 q_proj: A \[4, 32\] and B \[32, 4\] do not fit the base \(expected \[r, 64\] and "
        r"\[64, r\]\)"
    )
    assert_refused(sqlite_registry, src, "shape", message)


def test_unknown_target_module_is_refused(sqlite_registry, adapter_v1, tmp_path):
    src = rewrite_weights(
        adapter_v1,
        tmp_path / "unknown",
        lambda t: {k.replace("v_proj", "foo_proj"): v for k, v in t.items()},
    )
    assert_refused(
        sqlite_registry, src, "target_modules", "foo_proj is not a linear layer of LlamaForCausalLM"
    )


def rewrite_config(src, dst, **changes):
    """Copy an adapter, changing fields of its adapter_config.json (None deletes one)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    return dst


def test_weights_the_config_does_not_select_are_refused(sqlite_registry, adapter_v1, tmp_path):
    """PEFT loads only the modules its config selects and ignores other weights: serving those would
    serve another adapter than PEFT's."""
    cases = {
        "narrowed": dict(target_modules=["q_proj"]),
        "regex": dict(target_modules=r".*\.q_proj"),
        "layers": dict(layers_to_transform=[0]),
        "excluded": dict(exclude_modules=["v_proj"]),
    }
    for what, changes in cases.items():
        src = rewrite_config(adapter_v1, tmp_path / what, **changes)
        assert_refused(
            sqlite_registry,
            src,
            "target_modules",
            "v_proj has weights, but the config's target_modules"
            if what != "layers"
            else "layer 1 q_proj has weights",
        )
    src = rewrite_config(adapter_v1, tmp_path / "typed", target_modules=7)
    assert_refused(
        sqlite_registry, src, "target_modules", "neither a pattern nor a list of module names"
    )
    src = rewrite_config(adapter_v1, tmp_path / "typed-layers", layers_to_transform="0")
    assert_refused(sqlite_registry, src, "layers_to_transform", "neither a layer index nor a list")
    for what, changes in {
        "suffixes": dict(target_modules=["self_attn.q_proj", "v_proj"]),
        "regex": dict(target_modules=r"model\.layers\.\d+\.self_attn\.(q|v)_proj"),
        "none": dict(target_modules=None),
    }.items():
        sqlite_registry.add_revision(
            rewrite_config(adapter_v1, tmp_path / f"ok-{what}", **changes), f"ok-{what}"
        )


def test_disallowed_dtype_is_refused(sqlite_registry, adapter_v1, tmp_path):
    src = rewrite_weights(
        adapter_v1, tmp_path / "f64", lambda t: {k: v.double() for k, v in t.items()}
    )
    assert_refused(sqlite_registry, src, "dtype", "has dtype F64; allowed: F32, BF16, F16")


def test_other_base_model_name_is_refused_when_strict(
    sqlite_registry, adapter_factory, other_base_dir, llama_dir
):
    src = adapter_factory("other-base", base=other_base_dir)
    sqlite_registry.registration.strict_base_model_name = True
    assert_refused(
        sqlite_registry,
        src,
        "base_model_name_or_path",
        f"trained on '{other_base_dir}', not on the base model '{llama_dir.name}'",
    )


def test_other_base_model_name_with_fitting_shapes_is_a_warning(
    sqlite_registry, adapter_v1, llama_dir, tmp_path, caplog
):
    hub_id = "meta-llama/Llama-3.1-8B-Instruct"
    src = rewrite_config(adapter_v1, tmp_path / "hub-named", base_model_name_or_path=hub_id)
    with caplog.at_level("WARNING", logger="loraplex.registry"):
        record = sqlite_registry.add_revision(src, "chat", base_model_dir=llama_dir)
    assert record.base_model == llama_dir.name and record.status == "staging"
    (warning,) = [r for r in caplog.records if r.name == "loraplex.registry"]
    assert f"trained on '{hub_id}'" in warning.getMessage()
    assert "--strict-base-model-name" in warning.getMessage()


def test_digest_mismatch_is_refused(sqlite_registry, adapter_v1):
    wrong = "sha256:" + "0" * 64
    assert_refused(
        sqlite_registry,
        adapter_v1,
        "digest",
        f"the files hash to {canonical_digest(adapter_v1)}, not to the expected {wrong}",
        digest=wrong,
    )


def test_bad_name_and_eval_set_are_refused(sqlite_registry, adapter_v1, tmp_path):
    with pytest.raises(AdapterRejected, match="must match") as info:
        sqlite_registry.add_revision(adapter_v1, "Chat/../x")
    assert info.value.field == "name"
    evals = tmp_path / "evals.jsonl"
    evals.write_text('{"prompt": "hi", "expected": "hello"}\n{"prompt": "x"}\n')
    assert_refused(
        sqlite_registry,
        adapter_v1,
        "eval_set",
        'line 2 needs a string "expected" or "contains"',
        eval_set=evals,
    )


def test_signatures(make_registry, sqlite_url, adapter_v1):
    private, public = generate_keypair()
    other_private, _ = generate_keypair()
    registry = make_registry(sqlite_url, trusted_keys=(load_pem_public_key(public),))
    digest = canonical_digest(adapter_v1)
    assert_refused(registry, adapter_v1, "signature", "unsigned and trusted keys are configured")
    forged = sign_digest(digest, load_pem_private_key(other_private, None))
    assert_refused(
        registry, adapter_v1, "signature", f"no trusted key signed {digest}", signature=forged
    )
    assert_refused(registry, adapter_v1, "signature", "not valid base64", signature="ed25519:***")
    good = sign_digest(digest, load_pem_private_key(private, None))
    record = registry.add_revision(adapter_v1, "chat", signature=good)
    assert record.signature == good and record.digest == digest


def test_manifest_fields_from_a_valid_adapter(sqlite_registry, adapter_v3, llama_dir):
    record = sqlite_registry.add_revision(adapter_v3, "chat", warm_policy="cpu", priority=3)
    assert (record.rank, record.lora_alpha, record.dtype) == (8, 8.0, "F32")
    assert record.target_modules == ("down_proj", "k_proj", "q_proj")
    # (d_in + d_out) * r * 4 bytes per layer: q 64+64, k 64+32, down 128+64; two layers
    assert (
        record.estimated_bytes
        == 2 * ((64 + 64) + (64 + 32) + (128 + 64)) * 8 * 4
        == record.actual_bytes
    )
    assert record.base_model == llama_dir.name and record.base_model_digest.startswith("sha256:")
    assert record.task_type == "CAUSAL_LM" and record.warm_policy == "cpu" and record.priority == 3
    assert record.status == "staging" and record.storage_uri == sqlite_registry.store.uri(
        record.digest
    )


def test_base_model_named_by_the_adapter_is_used(tmp_path, adapter_v1, llama_dir):
    # no base model given
    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "store"))
    registry.init()
    assert registry.add_revision(adapter_v1, "chat").base_model == llama_dir.name
    src = shutil.copytree(adapter_v1, tmp_path / "nameless")
    config = json.loads((src / "adapter_config.json").read_text())
    (src / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "org/missing"})
    )
    with pytest.raises(
        AdapterRejected, match="no base model to validate against: pass --base-model DIR"
    ):
        registry.add_revision(src, "other")
    registry.close()


def test_sources_outside_the_allowed_roots_are_refused(
    make_registry, sqlite_url, adapter_v1, tmp_path
):
    root = tmp_path / "allowed"
    root.mkdir()
    registry = make_registry(sqlite_url, allowed=AllowList(roots=(root,)))
    with pytest.raises(Exception, match="outside the allowed roots"):
        registry.add_revision(adapter_v1, "chat")
    inside = root / "chat"
    inside.mkdir()
    shutil.copy(adapter_v1 / "adapter_config.json", inside)
    (inside / "adapter_model.safetensors").symlink_to(adapter_v1 / "adapter_model.safetensors")
    with pytest.raises(AdapterRejected, match="is a symlink out of the allowed root"):
        registry.add_revision(inside, "chat")
    (inside / "adapter_model.safetensors").unlink()
    shutil.copy(adapter_v1 / "adapter_model.safetensors", inside)
    assert registry.add_revision(inside, "chat").digest == canonical_digest(adapter_v1)
