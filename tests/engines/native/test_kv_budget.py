"""The KV cache's budget: the operator's figure, the CUDA share of the device, the CPU host rule,
and the one-line refusal that says which flag to change and by how much."""

import pytest
import torch

from loraplex.engines.native import kv_budget as kv
from loraplex.engines.native.config import EngineConfig
from loraplex.model_config import ModelConfig
from loraplex.server.engines import kv_budget_message
from loraplex.units import format_size, parse_size

GiB = 2**30


@pytest.fixture
def llama3_8b(tmp_path):
    """Llama-3-8B's config.json numbers (no weights: the budget needs the shapes only)."""
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "torch_dtype": "bfloat16",
        }
    )


def test_llama3_8b_needs_128_kib_a_token_in_bf16(llama3_8b):
    assert kv.kv_bytes_per_token(llama3_8b, torch.bfloat16) == 128 * 2**10


def test_gpu_budget_is_the_share_less_what_is_in_use_and_the_activations(llama3_8b, tmp_path):
    config = EngineConfig(model_dir=tmp_path, gpu_memory_utilization=0.9)
    total, weights = 80 * GiB, 16 * GiB  # an 80 GiB device holding 16 GiB of weights
    budget = kv.gpu_budget(config, llama3_8b, torch.bfloat16, total - weights, total)
    activations = kv.activation_bytes(llama3_8b, config, torch.bfloat16)
    assert budget.nbytes == int(0.9 * total) - weights - activations
    assert 0 < activations < 2 * GiB
    blocks = kv.num_blocks(budget, llama3_8b, torch.bfloat16, 16, 4096)
    assert blocks * 16 * 128 * 2**10 <= budget.nbytes


def test_too_small_a_gpu_share_says_which_share_would_do(llama3_8b, tmp_path):
    config = EngineConfig(model_dir=tmp_path, gpu_memory_utilization=0.3)
    total, free = 24 * GiB, 24 * GiB - 15 * GiB  # 15 GiB of weights on a 24 GiB device
    budget = kv.gpu_budget(config, llama3_8b, torch.bfloat16, free, total)
    assert budget.nbytes == 0
    with pytest.raises(kv.KVBudgetTooSmall) as refused:
        kv.num_blocks(budget, llama3_8b, torch.bfloat16, 16, 4096)
    line = kv_budget_message(refused.value)
    needed = 15 * GiB + kv.activation_bytes(llama3_8b, config, torch.bfloat16) + 512 * 2**20
    share = f"{-(-needed * 100 // total) / 100:.2f}"
    assert line == (
        f"--gpu-memory-utilization leaves 0 for the KV cache (0 tokens; 15GiB of the "
        f"device's 24GiB are in use), fewer than --max-model-len 4096 needs (512MiB): raise "
        f"it to {share} if the device has the room, give --kv-cache-memory-bytes 512MiB, "
        f"or lower --max-model-len"
    )


def test_host_rule_is_the_smaller_of_the_sequences_and_a_quarter_of_memory(
    llama3_8b, tmp_path, monkeypatch
):
    monkeypatch.setattr(kv, "host_available_bytes", lambda: 16 * GiB)
    few = EngineConfig(model_dir=tmp_path, max_num_seqs=2)
    budget = kv.kv_budget(few, llama3_8b, torch.bfloat16, torch.device("cpu"), 4096)
    assert (budget.source, budget.nbytes) == ("host", 2 * 4096 * 128 * 2**10)  # 1 GiB: what 2 need
    many = EngineConfig(model_dir=tmp_path, max_num_seqs=64)
    assert (
        kv.kv_budget(many, llama3_8b, torch.bfloat16, torch.device("cpu"), 4096).nbytes == 4 * GiB
    )
    monkeypatch.setattr(kv, "host_available_bytes", lambda: 1 * GiB)  # a quarter: 2048 tokens
    budget = kv.kv_budget(many, llama3_8b, torch.bfloat16, torch.device("cpu"), 4096)
    with pytest.raises(kv.KVBudgetTooSmall) as refused:
        kv.num_blocks(budget, llama3_8b, torch.bfloat16, 16, 4096)
    assert kv_budget_message(refused.value) == (
        "the KV cache's default on this host (a quarter of the 1GiB available) holds 2048 tokens, "
        "fewer than --max-model-len 4096: give --kv-cache-memory-bytes 512MiB or more, or lower "
        "--max-model-len to 2048"
    )


@pytest.mark.parametrize("n", [0, 1000, 512 * 2**20, 3 * GiB // 2, 5 * 2**40])
def test_format_size_reads_back(n):
    assert parse_size(format_size(n)) == n
