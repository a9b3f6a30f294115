"""The router's view of its workers: polled state, health, their pools, and the requests the router
has open on each.

A loraplex worker is polled for the routing view of its `/admin/state`, by generation: nothing when
nothing changed (304), else the rows changed since, applied to an index by adapter name. Bytes per
poll follow the worker's changes, not the number of adapters it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from typing import Any

import httpx

from loraplex.router.picker import WorkerView
from loraplex.router.pools import DEFAULT_POOL, PoolSpec, Reported, misconfigured
from loraplex.router.prefixes import PrefixIndex

log = logging.getLogger("loraplex.router")
_VLLM_LINE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")
_LABEL = re.compile(r'([a-z_]+)="([^"]*)"')


class Names(Set):
    """Adapter names held by any of a worker's rows in one tier: each name counts its rows, so that
    `name` stays while another revision of it still holds the tier."""

    def __init__(self):
        self._counts: Counter[str] = Counter()

    @classmethod
    def _from_iterable(cls, names: Iterable[Any]) -> Set[Any]:
        """What `|`, `&` and `-` make: a plain frozenset."""
        return frozenset(names)

    def __contains__(self, name: object) -> bool:
        return name in self._counts

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, names: set[str]) -> None:
        self._counts.update(names)

    def discard(self, names: set[str]) -> None:
        for name in names:
            self._counts[name] -= 1
            if self._counts[name] <= 0:
                del self._counts[name]


class RoutingIndex:
    """A worker's routing rows (tier and loading per adapter revision) by id, with the names in each
    tier: a row changes in time independent of how many the worker holds."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.gpu, self.cpu, self.loading = Names(), Names(), Names()

    def put(self, row: dict) -> None:
        self.remove(row["id"])
        self.rows[row["id"]] = row
        for names in self._sets(row):
            names.add(_names(row))

    def remove(self, row_id: str) -> None:
        row = self.rows.pop(row_id, None)
        if row is not None:
            for names in self._sets(row):
                names.discard(_names(row))

    def _sets(self, row: dict) -> list[Names]:
        tiers = {"gpu": [self.gpu], "cpu": [self.cpu]}.get(row["tier"], [])
        return tiers + [self.loading] if row["loading"] else tiers


def _names(row: dict) -> set[str]:
    """What a request may name the row's adapter by: its name, `name@revision`, its gateway
    model."""
    return {row["name"], f"{row['name']}@{row['revision']}", row.get("model") or row["name"]}


@dataclass
class Worker:
    url: str
    healthy: bool = True
    polled_at: float = 0.0
    last: WorkerView | None = None
    """Load and residency from the last poll."""
    in_flight: int = 0
    """Requests the router has open here: sent and not yet finished."""
    finished: int = 0
    """Requests of the router's that finished here since the last poll: each lets one that waits
    there run, so the polled queue is shorter by as many (to none)."""
    sent: set[str] = dataclasses.field(default_factory=set)
    """Adapters routed here since the last poll: counted as loading, so the next request for one
    follows it."""
    kind: str = "loraplex"
    failures: int = 0
    index: RoutingIndex = dataclasses.field(default_factory=RoutingIndex)
    generation: str | None = None
    """The generation of the routing view held (None: ask for all of it)."""
    state_bytes: int = 0
    """Body bytes of the last state answer (0 for a 304)."""
    draining: bool = False
    """The last state said the worker is shutting down."""
    pool: PoolSpec = PoolSpec(DEFAULT_POOL)
    reported: Reported = Reported()
    """Its base model and max rank, as its last state said."""
    problem: str | None = None
    """Why it cannot stand in its pool (None: it can); a worker with a problem gets no request."""
    prefixes: PrefixIndex = dataclasses.field(default_factory=lambda: PrefixIndex(0))
    """The prompt blocks routed here lately (`router/prefixes.py`)."""
    placed: frozenset[str] = frozenset()
    """The adapter names the placement controller keeps warm here, as its last state said."""
    drain: str | None = None
    """`draining` or `drained` once asked to drain (`POST /admin/drain`): no new request goes
    here."""

    def view(self, now: float, stale_after_s: float, prompt: tuple[int, ...] = ()) -> WorkerView:
        """The last poll's view, with what the router has open there beyond what that poll
        counted (so a request is counted once, however the polls fall), the adapters sent since
        and the share of `prompt`'s blocks routed here. Its residency sets are the index's own (a
        pick reads them at once): no copy per request."""
        last = self.last or WorkerView(self.url)
        fresh = now - self.polled_at <= stale_after_s
        waiting = max(0, last.waiting - self.finished)
        counted = waiting + last.running if fresh else 0
        return dataclasses.replace(
            last,
            waiting=waiting,
            num_open=self.in_flight,
            healthy=self.healthy and self.problem is None and self.drain is None,
            fresh=fresh,
            in_flight=max(0, self.in_flight - counted),
            loading=frozenset(last.loading) | self.sent if self.sent else last.loading,
            prefix=self.prefixes.match(prompt) if prompt else 0.0,
        )

    def take_reported(self, state: dict) -> None:
        """The base model and max rank a loraplex worker's state reports, checked against its
        pool's declaration, and the names placed on it and its drain."""
        rank = state.get("max_lora_rank")
        self.reported = Reported(
            state.get("base_model"),
            state.get("base_model_digest"),
            rank if isinstance(rank, int) else None,
        )
        self.placed = frozenset(state.get("placed") or ())
        self.drain = state.get("drain")
        problem = misconfigured(self.pool, self.reported)
        if problem != self.problem and problem is not None:
            log.error("worker %s is misconfigured, no request goes to it: %s", self.url, problem)
        elif problem != self.problem:
            log.info("worker %s matches pool %s again", self.url, self.pool.name)
        self.problem = problem

    def apply_routing(self, view: dict) -> None:
        """From a loraplex worker's `GET /admin/state?view=routing[&since=G]`: the rows changed and
        removed since G, or all of them (`reset`)."""
        if view.get("reset", True):
            self.index = RoutingIndex()
        for row_id in view.get("removed", []):
            self.index.remove(row_id)
        for row in view.get("adapters", []):
            self.index.put(row)
        self.generation = view.get("generation")
        self.draining = bool(view.get("draining"))
        self.take_reported(view)
        self._take_load(view.get("load", {}))

    def apply_state(self, state: dict) -> None:
        """From a loraplex worker's whole GET /admin/state (one that has no routing view)."""
        self.index = RoutingIndex()
        for a in state.get("adapters", []):
            row_id = f"{a['name']}@{a['revision']}/{a.get('digest')}"
            self.index.put({**a, "id": row_id, "loading": bool(a.get("loading"))})
        self.generation = None
        self.draining = bool(state.get("draining"))
        self.take_reported(state)
        self._take_load(state.get("load", {}))

    def _take_load(self, load: dict) -> None:
        self.last = WorkerView(
            self.url,
            waiting=load.get("waiting", 0),
            running=load.get("running", 0),
            active_tokens=load.get("active_tokens", 0),
            kv_usage=load.get("kv_cache_usage", 0.0),
            recent_evictions=load.get("recent_evictions", 0),
            free_slots=load.get("free_slots", 0),
            capacity=load.get("max_num_seqs", 0),
            gpu=self.index.gpu,
            cpu=self.index.cpu,
            loading=self.index.loading,
        )
        self.kind = "loraplex"

    def apply_vllm_metrics(self, text: str) -> None:
        """From a vLLM worker's /metrics (Gateway API Inference Extension series)."""
        gpu, waiting_adapters = set(), set()
        waiting = running = free_slots = 0
        kv_usage, newest = 0.0, -float("inf")
        for line in text.splitlines():
            match = _VLLM_LINE.match(line.strip())
            if not match:
                continue
            name, labels, value = match[1], dict(_LABEL.findall(match[2] or "")), float(match[3])
            if name == "vllm:num_requests_waiting":  # one series per engine: their sum
                waiting += int(value)
            elif name == "vllm:num_requests_running":
                running += int(value)
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv_usage = value
            elif name == "vllm:lora_requests_info" and value >= newest:
                # vLLM sets one series per set of labels to the time it was current, and old series
                # stay: the newest
                newest = value
                gpu = {a for a in labels.get("running_lora_adapters", "").split(",") if a}
                waiting_adapters = {
                    a for a in labels.get("waiting_lora_adapters", "").split(",") if a
                }
                max_lora = int(labels.get("max_lora", "0") or 0)
                free_slots = max(0, max_lora - len(gpu))
        self.last = WorkerView(
            self.url,
            waiting=waiting,
            running=running,
            kv_usage=kv_usage,
            free_slots=free_slots,
            gpu=frozenset(gpu),
            loading=frozenset(waiting_adapters),
        )
        self.kind = "vllm"


class Fleet:
    def __init__(
        self,
        urls: list[str],
        admin_token: str | None,
        stale_after_s: float = 2.0,
        poll_interval_s: float = 0.5,
        timeout_s: float = 2.0,
        pools: tuple[PoolSpec, ...] = (),
        prefix_blocks: int = 0,
    ):
        """`urls`: the workers of the default pool; `pools`: the declared pools, with theirs;
        `prefix_blocks`: the prompt blocks remembered per worker (0: none)."""
        self.pools = {p.name: p for p in (PoolSpec(DEFAULT_POOL), *pools)}
        self.prefix_blocks = prefix_blocks
        self.workers: dict[str, Worker] = {}
        for pool in self.pools.values():
            for url in urls if pool.name == DEFAULT_POOL else pool.workers:
                self.add(url, pool.name, healthy=True)
        self.admin_token = admin_token
        self.stale_after_s = stale_after_s
        self.poll_interval_s = poll_interval_s
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self._task: asyncio.Task | None = None
        self._polls: dict[str, asyncio.Task] = {}

    def views(self, prompt: tuple[int, ...] = ()) -> list[WorkerView]:
        """Each worker's view, with the share of `prompt`'s blocks routed there."""
        now = time.monotonic()
        return [w.view(now, self.stale_after_s, prompt) for w in self.workers.values()]

    def add(self, url: str, pool: str = DEFAULT_POOL, healthy: bool = False) -> Worker:
        """A worker in `pool` (KeyError: no such pool); one already here stays in its own."""
        url = url.rstrip("/")
        if url not in self.workers:
            prefixes = PrefixIndex(self.prefix_blocks)
            self.workers[url] = Worker(url, healthy, pool=self.pools[pool], prefixes=prefixes)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    async def _poll(self, worker: Worker) -> None:
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        sent, finished = set(worker.sent), worker.finished  # what the answer will count
        try:
            health = await self.client.get(f"{worker.url}/health")
            if health.status_code != 200:
                raise httpx.HTTPStatusError("unhealthy", request=health.request, response=health)
            params = {"view": "routing"}
            if worker.generation is not None:
                params["since"] = worker.generation
                headers = {**headers, "If-None-Match": f'"{worker.generation}"'}
            state = await self.client.get(
                f"{worker.url}/admin/state", headers=headers, params=params
            )
            worker.state_bytes = len(state.content)
            if state.status_code == 304:  # nothing changed: the view held is the worker's
                pass
            elif state.status_code == 200:
                body = state.json()
                if body.get("draining"):  # shutting down: it answers new requests 503
                    raise RuntimeError("shutting down")
                if "reset" in body:
                    worker.apply_routing(body)
                else:  # a worker that answers the whole state whatever is asked
                    worker.apply_state(body)
            else:  # not a loraplex worker, or no admin token: read the vLLM-style metrics instead
                metrics = await self.client.get(f"{worker.url}/metrics")
                metrics.raise_for_status()
                worker.apply_vllm_metrics(metrics.text)
            worker.polled_at = time.monotonic()
            worker.sent -= sent
            worker.finished -= finished
            if not worker.healthy:
                log.info("worker %s is healthy again", worker.url)
            worker.healthy, worker.failures = True, 0
        except Exception as exc:  # noqa: BLE001 (any bad answer marks the worker out; polling must go on)
            worker.failures += 1
            if worker.healthy:
                log.warning("worker %s marked out: %s", worker.url, exc)
                worker.prefixes.clear()  # a worker that comes back may have restarted: no KV
            worker.healthy = False

    async def _run(self) -> None:
        """Each worker on its own beat: a worker that hangs until the timeout does not hold the
        others' polls (their state would go stale, and routing by residency with it)."""
        polls = self._polls
        while True:
            for url, worker in list(self.workers.items()):
                if url not in polls or polls[url].done():
                    polls[url] = asyncio.create_task(self._poll(worker))
            for url in [u for u in polls if u not in self.workers]:
                polls.pop(url).cancel()
            await asyncio.sleep(self.poll_interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._polls.values():
            task.cancel()
        await asyncio.gather(*self._polls.values(), return_exceptions=True)
        await self.client.aclose()
