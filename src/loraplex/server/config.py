"""The API server's settings, apart from the server itself so that `serve` checks them before it
imports torch. The fields `serve` sets have their names, defaults and help in `ServeSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.settings.fields import check_fields
from loraplex.settings.serve import DEFAULTS as D
from loraplex.settings.serve import ServeSettings


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    """The base model's name in `model` fields and /v1/models."""
    admin_token: str | None = None
    """Bearer token of the admin API; None turns the admin API off (its paths answer 404)."""
    admin_on_main_app: bool = True
    """False when the admin API is served on its own port (`create_admin_app`)."""
    allowed_roots: tuple[str, ...] = ()
    audit_log: str | Path | None = None
    """JSONL file, `-` for stdout, None for none."""
    max_waiting: int = D.max_waiting
    max_requests_per_tenant: int | None = D.max_requests_per_tenant
    """None: no limit."""
    max_prompt_tokens: int | None = D.max_prompt_tokens
    max_body_bytes: int = D.max_body_bytes
    shutdown_timeout_s: float = D.shutdown_timeout_s
    unload_timeout_s: float = D.unload_timeout_s
    top_k_adapter_metrics: int = D.top_k_adapter_metrics
    lora_load_state_metrics: int = D.lora_load_state_metrics
    metrics_token: str | None = None
    """When set, /metrics answers only `Authorization: Bearer <token>` (it names running adapters
    and tenants)."""
    key_cache_ttl_s: float = D.key_cache_ttl_s
    registry_watch_s: float = D.registry_watch_s
    release_min_pass_rate: float = D.release_min_pass_rate

    def __post_init__(self):
        check_fields(self, ServeSettings)
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ValueError("the metrics token must be at least 16 characters")

    @classmethod
    def from_settings(
        cls, s: ServeSettings, admin_token: str | None, metrics_token: str | None
    ) -> ServerConfig:
        return cls(
            served_model_name=s.served_model_name or s.model.resolve().name,
            admin_token=admin_token,
            metrics_token=metrics_token,
            admin_on_main_app=s.admin_port is None,
            allowed_roots=s.allowed_roots,
            audit_log=s.audit_log_target,
            max_waiting=s.max_waiting,
            max_requests_per_tenant=s.max_requests_per_tenant,
            max_prompt_tokens=s.max_prompt_tokens,
            max_body_bytes=s.max_body_bytes,
            shutdown_timeout_s=s.shutdown_timeout_s,
            unload_timeout_s=s.unload_timeout_s,
            top_k_adapter_metrics=s.top_k_adapter_metrics,
            lora_load_state_metrics=s.lora_load_state_metrics,
            key_cache_ttl_s=s.key_cache_ttl_s,
            registry_watch_s=s.registry_watch_s,
            release_min_pass_rate=s.release_min_pass_rate,
        )
