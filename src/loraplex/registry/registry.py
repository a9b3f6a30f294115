"""The registry's Python API: register, roll out and roll back adapter revisions, tenants and keys.

Every change is one database transaction that also writes its audit event; reads see one committed
state. Which revision a request gets is the catalog's answer (`catalog.Catalog`), from memory.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from loraplex.artifacts import AllowList, ArtifactStore
from loraplex.registry.bulk import BulkImport
from loraplex.registry.errors import RegistryError
from loraplex.registry.lifecycle import LifeCycle
from loraplex.registry.reading import Reading
from loraplex.registry.records import NAME_RE
from loraplex.registry.registration import Registration
from loraplex.registry.retention import Retention
from loraplex.registry.store import Store, default_store_for
from loraplex.registry.tenancy import Tenancy, check_tenant_limits

__all__ = ["NAME_RE", "Registry", "check_tenant_limits", "default_store_for", "open_existing"]


class Registry:
    """A store and the services given it, behind one object: `Registry(url, store)` is the one to
    make. Its methods are those of its services, named here once."""

    def __init__(
        self,
        url: str,
        store: ArtifactStore | None = None,
        *,
        base_model_dir: str | Path | None = None,
        max_lora_rank: int = 64,
        trusted_keys: tuple = (),
        allowed: AllowList | None = None,
        storage_base: str | None = None,
        grace_period_s: float = 600.0,
        actor: str = "loraplex",
        strict_base_model_name: bool = False,
        unreachable_store: str | None = None,
        create: bool = True,
    ):
        """`store`: the artifact store (default: `artifacts/` beside a SQLite file); the other
        settings are those of `Registration` (`storage_base`, `unreachable_store`, ...), `Reading`
        (`grace_period_s`) and `Store` (`actor`, `create`)."""
        self.db = Store(url, store, actor, create)
        # `store` is the artifact store, as the constructor's argument names it
        self.url, self.engine, self.store = url, self.db.engine, self.db.artifacts
        self.registration = Registration(
            self.db,
            base_model_dir=base_model_dir,
            max_lora_rank=max_lora_rank,
            trusted_keys=trusted_keys,
            allowed=allowed,
            storage_base=storage_base,
            strict_base_model_name=strict_base_model_name,
            unreachable_store=unreachable_store,
        )
        self.bulk = BulkImport(self.registration)
        self.reading = Reading(self.db, timedelta(seconds=grace_period_s))
        self.lifecycle = LifeCycle(self.db, self.reading)
        self.retention = Retention(self.db, self.reading)
        self.tenancy = Tenancy(self.db)
        self._name_methods()

    def _name_methods(self) -> None:
        """The public methods: each is the method of the service that does it."""
        self.init = self.db.init
        self.close = self.db.close
        self.change_count = self.db.change_count
        self.add_revision = self.registration.add_revision
        self.gc_artifacts = self.registration.gc_artifacts
        self.add_revisions = self.bulk.add_revisions
        self.list_adapters = self.reading.list_adapters
        self.show = self.reading.show
        self.get_revision = self.reading.get_revision
        self.grace_revisions = self.reading.grace_revisions
        self.audit_events = self.reading.audit_events
        self.pieces = self.reading.pieces
        self.promote = self.lifecycle.promote
        self.set_traffic = self.lifecycle.set_traffic
        self.rollback = self.lifecycle.rollback
        self.deprecate = self.lifecycle.deprecate
        self.quarantine = self.lifecycle.quarantine
        self.pin = self.lifecycle.pin
        self.unpin = self.lifecycle.unpin
        self.set_keep = self.retention.set_keep
        self.delete_revision = self.retention.delete
        self.add_tenant = self.tenancy.add_tenant
        self.set_budget = self.tenancy.set_budget
        self.set_tenant_limits = self.tenancy.set_tenant_limits
        self.list_tenants = self.tenancy.list_tenants
        self.grant = self.tenancy.grant
        self.revoke_grant = self.tenancy.revoke_grant
        self.create_key = self.tenancy.create_key
        self.add_key = self.tenancy.add_key
        self.revoke_key = self.tenancy.revoke_key
        self.tenant_for_key = self.tenancy.tenant_for_key
        self.list_keys = self.tenancy.list_keys


def open_existing(url: str, **kwargs) -> Registry:
    """The registry at `url` as it is, for a command that only reads it: nothing is created, and a
    missing SQLite file, a database without tables, an unsupported URL, one that cannot be reached
    or a driver that is not installed is one RegistryError line."""
    registry = None
    try:
        registry = Registry(url, create=False, **kwargs)
        registry.db.check_ready()
        return registry
    except RegistryError:
        if registry is not None:
            registry.close()
        raise
    except (SQLAlchemyError, OSError, ImportError) as exc:
        if registry is not None:
            registry.close()
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise RegistryError(f"cannot open the registry: {reason}") from None
