"""The registry's Python API: register, resolve, roll out and roll back adapter revisions, tenants
and keys.

Every change is one database transaction that also writes its audit event; reads see one committed
state.
"""

from loraplex.registry.bulk import BulkRegistration
from loraplex.registry.core import NAME_RE, default_store_for
from loraplex.registry.lifecycle import LifeCycle
from loraplex.registry.resolution import Resolution
from loraplex.registry.tenancy import Tenancy, check_tenant_limits

__all__ = ["NAME_RE", "Registry", "check_tenant_limits", "default_store_for"]


class Registry(BulkRegistration, Resolution, LifeCycle, Tenancy):
    """The registry: each part is a module of its own (`core`, `registration`, `bulk`,
    `resolution`, `reading`, `lifecycle`, `tenancy`); `Registry(url, store)` is the one to make."""
