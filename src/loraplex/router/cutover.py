"""A fleet-wide cutover a trainer can wait on: after an upload registered a new revision, ask every
worker of the pools that serve it to load it (`POST /admin/adapters/{name}/prewarm` with
`wait_s`) and gather each one's readiness. A worker that fails (its load, or the call: it died) is
reported; the others go on."""

from __future__ import annotations

import asyncio
import time

import httpx

from loraplex.router.catalog import AdapterCatalog
from loraplex.router.fleet import Fleet
from loraplex.router.pools import Need, serves

DEFAULT_WAIT_S = 60.0
"""How long an upload with `wait=ready` waits when it names no `timeout`."""
MAX_WAIT_S = 3600.0
WAIT_MARGIN_S = 5.0
"""How much longer than the workers' own wait the router waits for their answers."""


def upload_worker(fleet: Fleet, catalog: AdapterCatalog | None, name: str, turn: int) -> str | None:
    """The worker an upload of `name` goes to: a healthy one of the pools that serve the name's
    revisions (any healthy one for a name the registry does not have yet), the least busy, and
    in turn among the equally busy; None when no worker is healthy."""
    healthy = [
        w for w in fleet.workers.values() if w.healthy and not w.draining and w.problem is None
    ]
    need = _need_of_name(catalog, name)
    fit = [w for w in healthy if serves(w.pool, w.reported, need)] or healthy
    if not fit:
        return None
    least = min(w.in_flight for w in fit)
    idle = [w for w in fit if w.in_flight == least]
    return idle[turn % len(idle)].url


def _need_of_name(catalog: AdapterCatalog | None, name: str) -> Need:
    """What the serving revisions of `name` need of a worker (nothing: a name the registry does
    not have, or no registry)."""
    facts = catalog.revisions(name) if catalog is not None else []
    digests = frozenset(f.base_model_digest for f in facts if f.base_model_digest)
    if not digests:
        return Need()
    return Need(base_digests=digests, rank=max(f.rank for f in facts))


def pool_workers(fleet: Fleet, record: dict) -> list[str]:
    """The workers of every pool that may serve the revision: its base model and rank fit, and the
    pool is shared or dedicated to a tenant that may use it (a shared adapter: every pool)."""
    digest = record.get("base_model_digest")
    need = Need(base_digests=frozenset({digest} if digest else ()), rank=int(record["rank"]))
    users = set(record.get("allowed_tenants") or ())
    return [
        w.url
        for w in fleet.workers.values()
        if serves(w.pool, w.reported, need)
        and (record.get("shared") or w.pool.shared or users & set(w.pool.tenants))
    ]


async def wait_ready(
    client: httpx.AsyncClient, urls: list[str], token: str, record: dict, wait_s: float
) -> dict:
    """{"ready": every worker ready, "seconds", "workers": [one row per worker]}."""
    began = time.perf_counter()
    rows = await asyncio.gather(*(_ready_on(client, url, token, record, wait_s) for url in urls))
    return {
        "ready": bool(rows) and all(r["ready"] for r in rows),
        "seconds": round(time.perf_counter() - began, 4),
        "workers": list(rows),
    }


async def _ready_on(
    client: httpx.AsyncClient, url: str, token: str, record: dict, wait_s: float
) -> dict:
    name, revision = record["name"], record["revision"]
    began = time.perf_counter()
    try:
        answer = await client.post(
            f"{url}/admin/adapters/{name}/prewarm",
            json={"revision": revision, "tier": "cpu", "wait_s": wait_s},
            headers={"Authorization": f"Bearer {token}"},
            timeout=wait_s + WAIT_MARGIN_S,
        )
        if answer.status_code == 200:
            return {"worker": url, **answer.json()["ready"][0]}
        error = f"{answer.status_code}: {_message(answer)}"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return {
        "worker": url,
        "model": f"{name}@{revision}",
        "ready": False,
        "tier": None,
        "error": error,
        "seconds": round(time.perf_counter() - began, 4),
    }


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:300]


def wait_of(query: dict[str, str]) -> float | None:
    """The seconds an upload's `?wait=ready&timeout=S` waits (None: it does not wait); ValueError
    saying what is wrong."""
    wait = query.get("wait")
    if wait is None:
        return None
    if wait != "ready":
        raise ValueError(f"wait={wait!r}: the one wait is `ready` (every worker of the pool)")
    try:
        timeout = float(query.get("timeout", DEFAULT_WAIT_S))
    except ValueError:
        raise ValueError(f"timeout={query['timeout']!r}: give seconds") from None
    if not 0 < timeout <= MAX_WAIT_S:
        raise ValueError(f"timeout must be more than 0 and at most {MAX_WAIT_S} s")
    return timeout
