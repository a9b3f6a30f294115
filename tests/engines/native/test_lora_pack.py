"""Packing an adapter's bytes for a slot (in place when the dtypes match) and writing it into a
slot."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save

from loraplex.engines.native import lora as lora_module
from loraplex.engines.native.lora import LoRASlotPool, pack_adapter
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, adapter_from_files
from loraplex.model_config import LINEAR_MODULES, ModelConfig

CFG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)
MAX_RANK = 8


def adapter(
    rank: int, dtype: torch.dtype, modules=LINEAR_MODULES, alpha: float = 7.0, seed: int = 0
):
    """Tensors and the files of a PEFT adapter (scaling alpha / rank: not a power of two, so
    rounding shows)."""
    torch.manual_seed(seed)
    tensors = {}
    for layer in range(CFG.num_layers):
        for module in modules:
            d_in, d_out = CFG.linear_shape(module)
            prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank).to(dtype)
    config = {"r": rank, "lora_alpha": alpha, "target_modules": list(modules)}
    return tensors, {
        CONFIG_FILE: json.dumps(config).encode(),
        WEIGHTS_FILE: bytearray(save(tensors)),
    }


def packed(files, dtype):
    """Packs a copy: packing in place consumes the bytes it is given."""
    return pack_adapter(
        adapter_from_files(files, CFG, MAX_RANK), bytearray(files[WEIGHTS_FILE]), dtype
    )


def fresh_slot(files, dtype) -> torch.Tensor:
    pool = LoRASlotPool(CFG, 1, MAX_RANK, dtype, "cpu")
    pool.set_slot(0, packed(files, dtype))
    return pool.buffer[0].clone()


@pytest.mark.parametrize(
    "file_dtype, dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
)
def test_slot_holds_a_and_scaled_bt_rounded_once(file_dtype, dtype):
    rank = 6
    tensors, files = adapter(rank, file_dtype)
    weights = torch.frombuffer(files[WEIGHTS_FILE], dtype=torch.uint8)
    pack = pack_adapter(adapter_from_files(files, CFG, MAX_RANK), files[WEIGHTS_FILE], dtype)
    in_place = weights.data_ptr() <= pack.buffer.data_ptr() < weights.data_ptr() + weights.numel()
    # no second host copy when the file already holds the dtype
    assert in_place == (file_dtype == dtype)
    pool = LoRASlotPool(CFG, 2, MAX_RANK, dtype, "cpu")
    pool.set_slot(1, pack)
    for layer in range(CFG.num_layers):
        for index, module in enumerate(LINEAR_MODULES):
            prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            assert torch.equal(pool.a[layer][index][1, :rank], a.to(dtype))
            assert torch.equal(
                pool.bt[layer][index][1, :rank], (b.float() * (7.0 / rank)).to(dtype).t()
            )
            assert (
                not pool.a[layer][index][1, rank:].any()
                and not pool.bt[layer][index][1, rank:].any()
            )
    assert not pool.buffer[0].any()


def test_a_reused_slot_keeps_nothing_of_its_previous_adapter():
    # every module at max rank: overwrites the whole slot
    _, full = adapter(MAX_RANK, torch.float32, seed=1)
    _, small = adapter(3, torch.float32, modules=("q_proj", "down_proj"), seed=2)
    expected_full, expected_small = (
        fresh_slot(full, torch.float32),
        fresh_slot(small, torch.float32),
    )
    pool = LoRASlotPool(CFG, 1, MAX_RANK, torch.float32, "cpu")
    for files, expected in ((full, expected_full), (small, expected_small), (full, expected_full)):
        pool.set_slot(0, packed(files, torch.float32))
        assert torch.equal(pool.buffer[0], expected)
        assert pool.module_ranks[0] == packed(files, torch.float32).module_ranks
    pool.clear_slot(0)
    assert not pool.buffer[0].any()
    pool.set_slot(0, packed(small, torch.float32))
    assert torch.equal(pool.buffer[0], expected_small)


# blocks of one row, of a few rows, and one block
@pytest.mark.parametrize("block_bytes", [4, 100, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocked_transpose_writes_every_row(monkeypatch, block_bytes, dtype):
    tensors, files = adapter(5, dtype)
    monkeypatch.setattr(lora_module, "_TRANSPOSE_BLOCK_BYTES", block_bytes)
    pool = LoRASlotPool(CFG, 1, MAX_RANK, dtype, "cpu")
    pool.set_slot(0, packed(files, dtype))
    for layer in range(CFG.num_layers):
        for index, module in enumerate(LINEAR_MODULES):
            b = tensors[f"base_model.model.{ModelConfig.module_path(layer, module)}.lora_B.weight"]
            assert torch.equal(pool.bt[layer][index][0, :5], (b * (7.0 / 5)).to(dtype).t())


def test_packing_in_place_overwrites_only_bytes_the_digest_check_has_read():
    _, files = adapter(MAX_RANK, torch.float32)
    weights = files[WEIGHTS_FILE]
    original = bytes(weights)
    granted = []

    def hashed(end):  # nothing at or past the furthest offset granted so far may have changed yet
        assert bytes(weights[max(granted, default=0) :]) == original[max(granted, default=0) :]
        granted.append(end)

    pack = pack_adapter(
        adapter_from_files(files, CFG, MAX_RANK), weights, torch.float32, hashed=hashed
    )
    assert granted == sorted(granted) and len(granted) == len(LINEAR_MODULES) * CFG.num_layers
    changed = [i for i in range(len(original)) if weights[i] != original[i]]
    assert changed and max(changed) < max(granted)
    expected = packed({**files, WEIGHTS_FILE: bytearray(original)}, torch.float32)
    assert torch.equal(pack.buffer, expected.buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaling_rounds_as_torch_does_out_to_overflow(dtype):
    """float32 is scaled in numpy, the others in torch: each B*scaling must match torch's product
    bit for bit, an overflow to inf included (and without a warning from numpy)."""
    tensors, files = adapter(3, dtype, alpha=1e6)
    prefix = f"base_model.model.{ModelConfig.module_path(0, 'down_proj')}.lora_B.weight"
    # times 1e6 / 3: past the largest finite
    tensors[prefix] = tensors[prefix] * torch.finfo(dtype).max / 4
    files[WEIGHTS_FILE] = bytearray(save(tensors))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = LoRASlotPool(CFG, 1, MAX_RANK, dtype, "cpu")
        pool.set_slot(0, packed(files, dtype))
    for layer in range(CFG.num_layers):
        for index, module in enumerate(LINEAR_MODULES):
            b = tensors[f"base_model.model.{ModelConfig.module_path(layer, module)}.lora_B.weight"]
            expected = torch.mul(b, 1e6 / 3).t()
            assert torch.equal(
                pool.bt[layer][index][0, :3].view(torch.uint8),
                expected.contiguous().view(torch.uint8),
            )
    assert torch.isinf(pool.bt[0][LINEAR_MODULES.index("down_proj")][0]).any()
