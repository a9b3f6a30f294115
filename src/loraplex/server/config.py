"""The API server's configuration, apart from the server itself so that `serve` checks it before it
imports torch. The server reads its tunable settings (`max_waiting`, `unload_timeout_s`, ...) from
`settings`, the `ServeSettings` they are declared in; this class adds only what `serve` derives
from them (the tokens read from their files, the audit log's target, the served name)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loraplex.settings.serve import DEFAULTS, ServeSettings


@dataclasses.dataclass(frozen=True, init=False)
class ServerConfig:
    served_model_name: str
    """The base model's name in `model` fields and /v1/models."""
    admin_token: str | None
    """Bearer token of the admin API; None turns the admin API off (its paths answer 404)."""
    admin_on_main_app: bool
    """False when the admin API is served on its own port (`create_admin_app`)."""
    audit_log: str | Path | None
    """JSONL file, `-` for stdout, None for none."""
    metrics_token: str | None
    """When set, /metrics answers only `Authorization: Bearer <token>` (it names running adapters
    and tenants)."""
    settings: ServeSettings
    """Every other setting the server reads, under its one name."""

    def __init__(
        self,
        served_model_name: str,
        admin_token: str | None = None,
        admin_on_main_app: bool = True,
        audit_log: str | Path | None = None,
        metrics_token: str | None = None,
        settings: ServeSettings = DEFAULTS,
        **overrides: Any,
    ):
        """`overrides`: settings by name over `settings` (checked as `serve` checks them)."""
        for token, what in ((admin_token, "admin"), (metrics_token, "metrics")):
            if token is not None and len(token) < 16:
                raise ValueError(f"the {what} token must be at least 16 characters")
        values = {
            "served_model_name": served_model_name,
            "admin_token": admin_token,
            "admin_on_main_app": admin_on_main_app,
            "audit_log": audit_log,
            "metrics_token": metrics_token,
            "settings": dataclasses.replace(settings, **overrides) if overrides else settings,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_settings(
        cls, s: ServeSettings, admin_token: str | None, metrics_token: str | None
    ) -> ServerConfig:
        return cls(
            served_model_name=s.served_model_name or s.model.resolve().name,
            admin_token=admin_token,
            admin_on_main_app=s.admin_port is None,
            audit_log=s.audit_log_target,
            metrics_token=metrics_token,
            settings=s,
        )
