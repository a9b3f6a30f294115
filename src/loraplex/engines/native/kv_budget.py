"""How much memory the paged KV cache gets: the operator's figure, or one sized from the device as
vLLM sizes it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engines.native.config import EngineConfig
from loraplex.model_config import ModelConfig

HOST_SHARE = 0.25
"""On CPU without kv_cache_memory_bytes: the share of the host's available memory the KV cache
may take."""
ACTIVATION_MARGIN = 2
"""The activation estimate on CUDA times this (attention's and sampling's temporaries on top)."""


@dataclass(frozen=True)
class KVBudget:
    nbytes: int
    source: str
    """kv_cache_memory_bytes (the operator's), gpu_memory_utilization (CUDA) or host (the CPU
    rule)."""
    detail: dict
    """What it was computed from, in bytes: total, used and activations (CUDA); available, wanted
    (CPU)."""


class KVBudgetTooSmall(ValueError):
    """The KV budget holds fewer tokens than one sequence of max_model_len; the fields say by how
    much."""

    def __init__(self, budget: KVBudget, holds: int, max_model_len: int, needed_bytes: int):
        self.budget, self.holds = budget, holds
        self.max_model_len, self.needed_bytes = max_model_len, needed_bytes
        super().__init__(
            f"{budget.source}: the KV cache ({budget.nbytes} bytes) holds {holds} "
            f"tokens, fewer than max_model_len {max_model_len} (which needs "
            f"{needed_bytes} bytes)"
        )


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def activation_bytes(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """An upper estimate of one step's activations: every batched token through the widest layer
    (the MLP's gate and up, or q/k/v), plus float32 logits of one row per sequence."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    width = max(2 * cfg.intermediate_size, qkv) + 4 * cfg.hidden_size
    per_step = config.max_num_batched_tokens * width * torch.finfo(dtype).bits // 8
    return ACTIVATION_MARGIN * (per_step + config.max_num_seqs * cfg.vocab_size * 4)


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable (what can be allocated without swapping), else the free pages."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> KVBudget:
    """The KV cache's bytes; call it once the weights and the adapter slots are on the device."""
    if config.kv_cache_memory_bytes is not None:
        return KVBudget(config.kv_cache_memory_bytes, "kv_cache_memory_bytes", {})
    if device.type == "cuda":
        return gpu_budget(config, cfg, dtype, *torch.cuda.mem_get_info(device))
    available = host_available_bytes()
    wanted = config.max_num_seqs * max_model_len * kv_bytes_per_token(cfg, dtype)
    detail = {"available": available, "wanted": wanted}
    return KVBudget(min(wanted, int(available * HOST_SHARE)), "host", detail)


def gpu_budget(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, free: int, total: int
) -> KVBudget:
    """What gpu_memory_utilization of the device leaves for the KV cache: everything in use now (the
    weights, the adapter slots, other processes) and the activation estimate come off its share."""
    used, activations = total - free, activation_bytes(cfg, config, dtype)
    nbytes = max(0, int(total * config.gpu_memory_utilization) - used - activations)
    detail = {"total": total, "used": used, "activations": activations}
    return KVBudget(nbytes, "gpu_memory_utilization", detail)


def num_blocks(
    budget: KVBudget, cfg: ModelConfig, dtype: torch.dtype, block_size: int, max_model_len: int
) -> int:
    """Blocks the budget holds; KVBudgetTooSmall when they hold fewer tokens than max_model_len."""
    per_block = block_size * kv_bytes_per_token(cfg, dtype)
    blocks = budget.nbytes // per_block
    if blocks * block_size < max_model_len:
        needed = -(-max_model_len // block_size) * per_block
        raise KVBudgetTooSmall(budget, blocks * block_size, max_model_len, needed)
    return blocks
