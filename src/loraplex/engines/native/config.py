"""The native engine's configuration: the settings `serve` passes it, under their names and with
their defaults (`loraplex.settings.serve`), and what the engine alone needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.settings.fields import check_fields, same_named
from loraplex.settings.serve import DEFAULTS as D
from loraplex.settings.serve import ServeSettings
from loraplex.settings.serve_values import HOST_CACHE_BYTES

if TYPE_CHECKING:
    from loraplex.artifacts import ArtifactStore


@dataclass(frozen=True)
class EngineConfig:
    """Each field that `serve` sets is described where it is declared (`ServeSettings`)."""

    model_dir: Path
    dtype: str = D.dtype
    device: str = D.device
    max_loras: int = D.max_loras
    max_lora_rank: int = D.max_lora_rank
    max_num_seqs: int = D.max_num_seqs
    max_model_len: int | None = D.max_model_len
    max_num_batched_tokens: int = D.max_num_batched_tokens
    kv_cache_memory_bytes: int | None = D.kv_cache_memory_bytes
    gpu_memory_utilization: float = D.gpu_memory_utilization
    block_size: int = D.block_size
    enable_prefix_caching: bool = True
    """Share the KV blocks of a prompt prefix between requests of one adapter revision."""
    max_lora_bytes_per_step: int | None = D.max_lora_bytes_per_step
    max_cpu_loras: int | None = D.max_cpu_loras
    cpu_cache_bytes: int = HOST_CACHE_BYTES
    eviction_policy: str = D.eviction_policy
    disk_cache_dir: Path | None = None
    """Local content-addressed cache of artifacts fetched from remote stores (None: no disk
    tier)."""
    disk_cache_bytes: int = D.disk_cache_bytes
    allowed_roots: tuple[str, ...] = ()
    """Directories and URL prefixes that adapter storage URIs may point into."""
    tenant_gpu_share: float = D.tenant_gpu_share
    tenant_cpu_share: float = D.tenant_cpu_share
    max_gpu_preferred: int | None = D.max_gpu_preferred
    load_threads: int = D.load_threads
    thrash_window_s: float = D.thrash_window_s
    seed: int = D.seed

    def __post_init__(self):
        check_fields(self, ServeSettings)
        object.__setattr__(self, "model_dir", Path(self.model_dir))

    @classmethod
    def from_settings(cls, s: ServeSettings, store: ArtifactStore | None = None) -> EngineConfig:
        """`store`: the registry's artifact store, a trusted source of artifacts for the disk
        tier."""
        roots = s.allowed_roots
        if store is not None:
            roots = (*roots, str(store.root.resolve()))
        values = same_named(cls, s)
        if s.cpu_cache_bytes is None:  # the engine's own default
            del values["cpu_cache_bytes"]
        if s.enable_prefix_caching is None:  # the engine's own default: on
            del values["enable_prefix_caching"]
        values.update(model_dir=s.model, disk_cache_dir=s.data_dir / "cache")
        return cls(**{**values, "allowed_roots": tuple(roots)})
