"""A pool as `loraplex router` declares it (`--pool`, the `pool` list of `--config`): its base
model, its max LoRA rank, the tenants it is dedicated to (none: shared), its workers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_POOL = "default"
"""The pool of the workers given by `--worker` (and added through the admin API without one):
shared, no base or rank declared."""
_KEYS = ("name", "base-model", "base-model-digest", "max-rank", "tenants", "workers", "role")
ROLES = ("warm", "canary")
"""A pool's optional role: `warm` takes the pinned and tier-A adapters' requests first, `canary` a
rollout's canary revision's."""


@dataclass(frozen=True)
class PoolSpec:
    name: str
    base_model: str | None = None
    """The served name of its base model, as its workers report it (None: not declared)."""
    base_model_digest: str | None = None
    """The base model's digest (`sha256:...`) its workers must report (None: not checked)."""
    max_rank: int | None = None
    """The highest adapter rank it serves; its workers' `--max-lora-rank` must reach it."""
    tenants: tuple[str, ...] = ()
    """The tenants it is dedicated to; none: shared by every tenant."""
    workers: tuple[str, ...] = ()
    role: str | None = None
    """`warm`, `canary`, or None (`ROLES`)."""

    def __post_init__(self):
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"pool {self.name}: role {self.role!r}: use {' or '.join(ROLES)}")
        if not self.name or any(c in self.name for c in " ,=+"):
            raise ValueError(f"pool name {self.name!r}: give a word (no spaces, ',', '=', '+')")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"pool {self.name}: max-rank must be at least 1")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"pool {self.name}: worker {url!r} is not an http(s) URL")

    @property
    def shared(self) -> bool:
        return not self.tenants

    def as_dict(self) -> dict[str, Any]:
        """The `--config` form (`parse_pool` reads it back)."""
        values = (
            self.name,
            self.base_model,
            self.base_model_digest,
            self.max_rank,
            list(self.tenants),
            list(self.workers),
            self.role,
        )
        return {k: v for k, v in zip(_KEYS, values) if v not in (None, [])}


def parse_pool(raw: Any) -> PoolSpec:
    """A pool from a `--config` mapping, or a flag's `name=N,base-model=B,max-rank=R,
    tenants=T1+T2,workers=URL1+URL2,role=warm` (ValueError saying what is wrong)."""
    if isinstance(raw, str):
        raw = dict(_pair(part) for part in raw.split(",") if part.strip())
    if not isinstance(raw, dict):
        raise ValueError(f"a pool is a mapping of {', '.join(_KEYS)}, not {raw!r}")
    unknown = [k for k in raw if str(k).replace("_", "-") not in _KEYS]
    if unknown:
        raise ValueError(f"pool key {unknown[0]!r}: the keys are {', '.join(_KEYS)}")
    given = {str(k).replace("_", "-"): v for k, v in raw.items()}
    if "name" not in given:
        raise ValueError("a pool needs a name")
    rank = given.get("max-rank")
    try:
        max_rank = None if rank is None else int(rank)
    except ValueError:
        raise ValueError(f"pool {given['name']}: max-rank {rank!r} is not an integer") from None
    return PoolSpec(
        name=str(given["name"]),
        base_model=_text(given.get("base-model")),
        base_model_digest=_text(given.get("base-model-digest")),
        max_rank=max_rank,
        tenants=_words(given.get("tenants")),
        workers=tuple(u.rstrip("/") for u in _words(given.get("workers"))),
        role=_text(given.get("role")),
    )


def parse_pools(raw: Any) -> tuple[PoolSpec, ...]:
    """`--pool` (repeated) or the `pool` list of a `--config` file; names and workers once each."""
    items = raw if isinstance(raw, list | tuple) else str(raw).split()  # a variable: SPEC SPEC
    pools = tuple(parse_pool(item) for item in items if item not in (None, ""))
    check_pools(pools)
    return pools


def check_pools(pools: Iterable[PoolSpec]) -> None:
    names: set[str] = set()
    owner: dict[str, str] = {}
    for pool in pools:
        if pool.name in names or pool.name == DEFAULT_POOL:
            raise ValueError(f"pool name {pool.name!r} is taken: give each pool its own")
        names.add(pool.name)
        for url in pool.workers:
            if url in owner:
                raise ValueError(f"worker {url} is in pools {owner[url]} and {pool.name}")
            owner[url] = pool.name


def _pair(part: str) -> tuple[str, str]:
    key, sep, value = part.partition("=")
    if not sep:
        raise ValueError(f"{part!r}: expected KEY=VALUE, KEY one of {', '.join(_KEYS)}")
    return key.strip(), value.strip()


def _text(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def _words(value: Any) -> tuple[str, ...]:
    """A list, or `a+b` text."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else str(value).split("+")
    return tuple(str(v).strip() for v in items if str(v).strip())
