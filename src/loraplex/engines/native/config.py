"""The native engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = "auto"
    """auto (the model's own dtype), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    max_loras: int = 4
    """Adapter slots on the device: at most this many distinct adapters run in one batch."""
    max_lora_rank: int = 64
    """Slots are padded to this rank; adapters above it are refused."""
    max_num_seqs: int = 64
    """Sequences in the running batch."""
    max_model_len: int | None = None
    """Prompt plus completion tokens per sequence (default: the model's max_position_embeddings,
    capped at 4096)."""
    max_num_batched_tokens: int = 4096
    """Tokens one step may process (prefill tokens plus one per decoding sequence); a longer prompt
    is prefilled in chunks over several steps."""
    kv_cache_bytes: int | None = None
    """Memory for the paged KV cache (vLLM's kv_cache_memory_bytes). None: on CUDA, what
    `gpu_memory_utilization` leaves after the weights; on CPU, the smaller of what `max_num_seqs`
    sequences of `max_model_len` tokens need and a quarter of the host's available memory."""
    gpu_memory_utilization: float = 0.9
    """On CUDA without kv_cache_bytes: the share of the device's memory this engine may fill
    (weights, adapter slots, activations and the KV cache, which gets the rest), as vLLM's."""
    block_size: int = 16
    """Tokens per KV block."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of a prompt prefix between requests of one adapter revision."""
    max_lora_bytes_per_step: int | None = None
    """Rank-aware admission: cap on the summed bytes of the distinct adapters in one step (None:
    no cap)."""
    max_cpu_loras: int | None = None
    """Host-memory adapter copies kept ready for a slot (count)."""
    cpu_cache_bytes: int = 2 * 2**30
    """Host-memory adapter copies kept ready for a slot (bytes)."""
    eviction_policy: str = "score"
    """score (default) or lru."""
    disk_cache_dir: Path | None = None
    """Local content-addressed cache of artifacts fetched from remote stores (None: no disk
    tier)."""
    disk_cache_bytes: int = 20 * 2**30
    """Byte budget of the disk tier."""
    allowed_roots: tuple[str, ...] = ()
    """Directories and URL prefixes that adapter storage URIs may point into."""
    tenant_gpu_share: float = 1.0
    """Default budget of a tenant without its own: this share of the gpu slots (1.0: no limit)."""
    tenant_cpu_share: float = 1.0
    """Default budget of a tenant without its own: this share of cpu_cache_bytes (1.0: no limit)."""
    max_gpu_preferred: int | None = None
    """Adapters that demand may promote to the gpu warm set; None: max_loras."""
    load_threads: int = 2
    """Threads that download, verify and read adapters (loads of different adapters overlap)."""
    thrash_window_s: float = 60.0
    """An eviction followed by a reload within this many seconds counts as thrash (metrics)."""
    seed: int = 0
    """Seed of sampling for requests that give none of their own."""

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.max_num_seqs < 1 or self.block_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                "max_num_seqs, block_size and max_num_batched_tokens must be at least 1"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization {self.gpu_memory_utilization}: use a share in (0, 1]"
            )
        if self.load_threads < 1:
            raise ValueError("load_threads must be at least 1")
        if self.max_gpu_preferred is not None and self.max_gpu_preferred < 0:
            raise ValueError("max_gpu_preferred must be at least 0")
        if self.thrash_window_s <= 0:
            raise ValueError("thrash_window_s must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r}: use auto, cpu or cuda")
        shares = (
            ("tenant_gpu_share", self.tenant_gpu_share),
            ("tenant_cpu_share", self.tenant_cpu_share),
        )
        for name, share in shares:
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], not {share}")
        if self.eviction_policy not in ("score", "lru"):
            raise ValueError(f"eviction_policy {self.eviction_policy!r}: use score or lru")
        object.__setattr__(self, "model_dir", Path(self.model_dir))
