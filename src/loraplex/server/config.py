"""The API server's settings, apart from the server itself so that `serve` checks them before it
imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    """The base model's name in `model` fields and /v1/models."""
    admin_token: str | None = None
    """Bearer token of the admin API; None turns the admin API off (its paths answer 404)."""
    admin_on_main_app: bool = True
    """False when the admin API is served on its own port (`create_admin_app`)."""
    allowed_roots: tuple[str, ...] = ()
    """Directories (and URL prefixes) the admin API may register adapters from."""
    audit_log: str | Path | None = None
    """JSONL file, `-` for stdout, None for none."""
    max_waiting: int = 512
    """Requests admitted but without a first token yet; beyond this, 429 with Retry-After."""
    max_requests_per_tenant: int | None = 256
    """Requests in flight per tenant; beyond this, 429 with Retry-After (None: no limit)."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted (default: the engine's max_model_len - 1)."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body (413 beyond)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long requests in flight may take to finish before they are aborted."""
    unload_timeout_s: float = 60.0
    """How long an unload waits for the adapter's requests in flight."""
    top_k_adapter_metrics: int = 0
    """Per-adapter request counts for the K busiest adapters in /metrics (0: none)."""
    lora_load_state_metrics: int = 0
    """Residency series (`vllm:lora_adapter_loaded`, ...) of the K best-placed adapters (0: off)."""
    metrics_token: str | None = None
    """When set, /metrics answers only `Authorization: Bearer <token>` (it names running adapters
    and tenants)."""
    key_cache_ttl_s: float = 5.0
    """How long a registry API key lookup is trusted (revocations take effect within this)."""
    registry_watch_s: float = 2.0
    """How often the server looks for traffic changes made elsewhere (the registry CLI) to move pins
    along."""
    release_min_pass_rate: float = 1.0
    """Share of a revision's eval-set cases that must pass for a promotion out of staging."""

    def __post_init__(self):
        if self.max_waiting < 0 or (
            self.max_requests_per_tenant is not None and self.max_requests_per_tenant < 1
        ):
            raise ValueError("max_waiting must be >= 0 and max_requests_per_tenant >= 1")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ValueError("the metrics token must be at least 16 characters")
        if not 0.0 <= self.release_min_pass_rate <= 1.0:
            raise ValueError(
                f"release_min_pass_rate {self.release_min_pass_rate}: use a share in [0, 1]"
            )
        too_short = self.max_prompt_tokens is not None and self.max_prompt_tokens < 1
        if self.max_body_bytes < 1 or too_short:
            raise ValueError("max_body_bytes and max_prompt_tokens must be at least 1")
