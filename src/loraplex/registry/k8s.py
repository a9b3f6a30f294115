"""The registry's traffic split as Kubernetes objects: one llm-d `InferenceModelRewrite` per adapter
name, so the split the registry holds (a canary at 10%, a rollback) is the one the gateway
applies."""

from __future__ import annotations

import hashlib
import re

from loraplex.registry.records import AdapterRecord
from loraplex.registry.traffic import gateway_model

REWRITE_API = "llm-d.ai/v1alpha2"
MANAGED_BY = {"app.kubernetes.io/managed-by": "loraplex"}
_NOT_DNS = re.compile(r"[^a-z0-9.-]")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def object_name(pool: str, name: str) -> str:
    """A DNS subdomain for the name's object. Adapter names may hold `_`, which Kubernetes names may
    not: such a name gets a hash of itself, so `a_b` and `a-b` stay two objects."""
    cleaned = _NOT_DNS.sub("-", name)
    suffix = "" if cleaned == name else "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{pool}-{cleaned}{suffix}".strip(".-")


def model_rewrite(adapter: AdapterRecord, pool: str, namespace: str | None) -> dict | None:
    """The rewrite of requests for `adapter.name` to its serving revisions by weight; None when none
    serves."""
    weights = [(revision, weight) for revision, weight in adapter.traffic if weight > 0]
    if not weights:
        return None
    serving = frozenset(revision for revision, _ in weights)
    metadata = {
        "name": object_name(pool, adapter.name),
        "labels": {**MANAGED_BY, "loraplex/pool": pool},
    }
    if namespace:
        metadata["namespace"] = namespace
    targets = [
        {"modelRewrite": gateway_model(adapter.name, revision, serving), "weight": weight}
        for revision, weight in weights
    ]
    return {
        "apiVersion": REWRITE_API,
        "kind": "InferenceModelRewrite",
        "metadata": metadata,
        "spec": {
            "poolRef": {
                "group": "inference.networking.k8s.io",
                "kind": "InferencePool",
                "name": pool,
            },
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": adapter.name}}],
                    "targets": targets,
                }
            ],
        },
    }


def check_names(pool: str, namespace: str | None) -> None:
    for flag, value in (("--pool", pool), ("--namespace", namespace)):
        if value is not None and (len(value) > 63 or not _DNS_LABEL.match(value)):
            raise ValueError(
                f"{flag} {value!r}: not a Kubernetes name (lowercase letters, digits and '-')"
            )


def model_rewrites(
    adapters: list[AdapterRecord], pool: str, namespace: str | None = None
) -> list[dict]:
    check_names(pool, namespace)
    return [obj for obj in (model_rewrite(a, pool, namespace) for a in adapters) if obj is not None]
