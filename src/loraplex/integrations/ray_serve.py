"""Ray Serve: a loraplex worker per replica, adapters as multiplexed models, routed by loraplex's
picker.

Each replica runs a whole `loraplex serve` worker (registry, tiers, policy, audit) on a local
port and answers handle calls by forwarding them to it. Ray's multiplexing names the adapter
(`multiplexed_model_id`); the replica's model loader is loraplex's cache (a prewarm into host
memory). The request router ranks replicas with `loraplex.router.picker` (affinity until
saturated) over what each replica reports of its residency, device slots and host memory both,
which Ray's own multiplexed routing does not see.

    options = ServeSettings(model=..., data_dir=..., registry=URL)
    handle = serve.run(deployment(options, num_replicas=2))
    answer = await handle.options(multiplexed_model_id="sql").completions.remote({"prompt": "..."})

A fleet of pools (several base models or ranks) is one deployment per pool: `run_pools`, each
replica's worker checked against its pool's declaration as `loraplex router` checks its workers;
the router deployment of `ray_router.run_router` in front of them picks the pool for each request.
Inside a pool the request router honours the placement controller's placements and scores prompt
prefixes (`loraplex.router.routing`, `loraplex.router.prefixes`), as `loraplex router` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import uvicorn

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import (
        MultiplexMixin,
        PendingRequest,
        ReplicaID,
        RequestRouter,
        RunningReplica,
    )
except ImportError as exc:
    if exc.name != "ray":
        raise
    raise ImportError(
        "loraplex.integrations.ray_serve needs the ray extra: pip install 'loraplex[ray]'",
        name="ray",
    ) from None

from loraplex.model_config import base_model_digest
from loraplex.registry.registry import open_existing
from loraplex.router.catalog import AdapterCatalog, registry_catalog
from loraplex.router.fleet import Worker
from loraplex.router.picker import Picker, PickerConfig, WorkerView
from loraplex.router.pools import DEFAULT_POOL, PoolSpec, Reported, misconfigured
from loraplex.router.prefixes import PrefixIndex, block_hashes, prompt_text
from loraplex.router.routing import Wanted, among, placed_here, placed_in, prefix_key
from loraplex.server.preflight import bind
from loraplex.server.serve import build
from loraplex.settings.pools import parse_pool
from loraplex.settings.router import DEFAULTS as ROUTER
from loraplex.settings.serve import ServeSettings

log = logging.getLogger("loraplex.ray")
MAX_ADAPTERS_PER_REPLICA = 4096
"""Ray's multiplexed set per replica: loraplex's cache decides residency, so Ray is not to unload on
its own."""


class LoraplexReplica:
    """One replica: a loraplex worker on a local port (`options.host`, 127.0.0.1 by default: routers
    on the same node only; 0.0.0.0 with API keys for a cluster of several nodes) and the calls
    Ray routes to it."""

    def __init__(self, options: ServeSettings, admin_token: str, pool: PoolSpec | None = None):
        """`pool`: the declaration the replica's worker must match (its base model, digest and
        max rank, as its state reports them); a replica that does not match fails to start."""
        replica = serve.get_replica_context().replica_id.unique_id
        # The registry is the fleet's; the disk cache, audit log and admin token are the
        # replica's own.
        data_dir = Path(options.data_dir) / f"replica-{replica}"
        data_dir.mkdir(parents=True, exist_ok=True)
        token_file = data_dir / "admin-token"
        token_file.write_text(admin_token + "\n")
        token_file.chmod(0o600)
        options = dataclasses.replace(
            options,
            data_dir=data_dir,
            registry=options.registry_url,
            admin_token_file=token_file,
            admin_port=None,
            port=0,
        )
        app, _ = build(options)
        self.replica = replica
        self.placement = app.state.server.placement
        self.admin = {"Authorization": f"Bearer {admin_token}"}
        self._sock = bind(options.host, 0)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        ).start()
        # Routers on other nodes reach a worker listening on every address through its
        # node's address.
        host = ray.util.get_node_ip_address() if options.host in ("0.0.0.0", "::") else options.host
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        # Where this replica's worker listens, for an operator's curl of its admin API.
        (data_dir / "worker.json").write_text(json.dumps({"url": self.url}))
        self.http = httpx.AsyncClient(base_url=self.url, timeout=None)
        deadline = time.monotonic() + 120
        # The engine and the registry are up once uvicorn's lifespan ran.
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the loraplex worker did not start")
            time.sleep(0.05)
        if pool is not None:
            self._check_pool(pool)

    def _check_pool(self, pool: PoolSpec) -> None:
        """RuntimeError when the worker's reported base model, digest or max rank do not match
        `pool` (`loraplex.router.pools.misconfigured`): Ray then never routes to it."""
        state = httpx.get(f"{self.url}/admin/state", headers=self.admin, timeout=30).json()
        rank = state.get("max_lora_rank")
        reported = Reported(
            state.get("base_model"),
            state.get("base_model_digest"),
            rank if isinstance(rank, int) else None,
        )
        problem = misconfigured(pool, reported)
        if problem is not None:
            self._server.should_exit = True
            raise RuntimeError(f"replica {self.replica} of pool {pool.name}: its worker {problem}")

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def load_adapter(self, model_id: str) -> str:
        """Ray's loader for an adapter: loraplex's cache brings it into host memory (its digest
        checked)."""
        name, _, revision = model_id.partition("@")
        body = {"tier": "cpu", **({"revision": revision} if revision else {})}
        response = await self.http.post(
            f"/admin/adapters/{name}/prewarm", json=body, headers=self.admin
        )
        if response.status_code != 200:  # unknown here: the request itself answers 404
            log.info("prewarm of %s: %s", model_id, response.text)
        return model_id

    async def completions(self, body: dict, authorization: str | None = None) -> dict:
        """POST /v1/completions on this replica's worker, for the multiplexed model (else
        `body["model"]`)."""
        return await self._forward("/v1/completions", body, authorization)

    async def chat_completions(self, body: dict, authorization: str | None = None) -> dict:
        return await self._forward("/v1/chat/completions", body, authorization)

    async def _forward(self, path: str, body: dict, authorization: str | None) -> dict:
        model = serve.get_multiplexed_model_id()
        if model:
            await self.load_adapter(model)
            body = {**body, "model": model}
        headers = {"Authorization": authorization} if authorization else {}
        response = await self.http.post(path, json=body, headers=headers)
        return {
            "status": response.status_code,
            "body": response.json(),
            "replica": self.replica,
            "worker": self.url,
            "tier": response.headers.get("x-loraplex-cache-tier"),
        }

    async def models(self, authorization: str | None = None) -> dict:
        """GET /v1/models on this replica's worker: what the caller may use on it."""
        headers = {"Authorization": authorization} if authorization else {}
        response = await self.http.get("/v1/models", headers=headers)
        return {"status": response.status_code, "body": response.json()}

    def placed(self) -> bool:
        """Whether the placement controller placed the multiplexed model on this replica's worker:
        the pool's request router sends a call for a placed adapter to a replica it is placed on
        while one has room, so the answer is the pool's (`ray_router`'s pool choice asks it)."""
        model = serve.get_multiplexed_model_id()
        return bool(model) and placed_in(self.placement.state(0)["placed"], model)

    def record_replica_metadata(self) -> dict:
        """Ray passes this to the routers once the replica is up: where they poll its worker."""
        return {"worker_url": self.url}

    def __del__(self):
        server = getattr(self, "_server", None)
        if server is not None:
            server.should_exit = True


class LoraplexRequestRouter(MultiplexMixin, RequestRouter):
    """Ranks replicas by loraplex's affinity-until-saturated picker, one replica per rank (Ray takes
    the first rank whose replica has room). It polls each replica's worker (`GET /admin/state`,
    as `loraplex router` does): Ray's routing stats reach a router only when the replica set
    changes, too late for residency."""

    # Ray probes a replica's queue length before sending, and skips to the next rank when the
    # answer is late: a replica busy in its engine steps answers late, and a skip is a request
    # sent away from its adapter.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0

    def initialize_state(
        self,
        admin_token: str,
        policy: str = "affinity",
        max_waiting: int = 5,
        max_kv_usage: float = 0.8,
        w_tokens: float = 0.0,
        poll_s: float = 0.25,
        stale_s: float = 2.0,
        pool: dict | None = None,
        registry_url: str | None = None,
        prefix_blocks: int = ROUTER.prefix_index_blocks,
    ):
        """`w_tokens` is 0 by default: a replica's token count reaches the router a poll late, while
        its own count of requests in flight is current, so load is weighed by requests alone.
        `pool`: the declaration (`PoolSpec.as_dict`) each replica's reported state is checked
        against; `registry_url`: where an adapter's revision digest is read, the key of its prompt
        blocks; `prefix_blocks`: prompt blocks remembered per replica (0: no prefix scoring)."""
        config = PickerConfig(
            saturation_waiting=max_waiting, saturation_kv_usage=max_kv_usage, w_tokens=w_tokens
        )
        self.picker = Picker(policy, config)
        self.headers = {"Authorization": f"Bearer {admin_token}"}
        self.poll_s, self.stale_s = poll_s, stale_s
        self.workers: dict[ReplicaID, Worker] = {}
        self.in_flight: dict[ReplicaID, int] = defaultdict(int)  # routed here and not completed
        self._requests: dict[str, ReplicaID] = {}  # internal request id -> replica
        # When this router's last request there ended.
        self.completed_at: dict[ReplicaID, float] = {}
        self._poller: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self.pool = PoolSpec(DEFAULT_POOL) if pool is None else parse_pool(pool)
        self.registry_url, self.prefix_blocks = registry_url, prefix_blocks
        self._catalog: AdapterCatalog | None = None
        self._prompts: dict[str, tuple[int, ...]] = {}  # internal request id -> its prompt blocks

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if self._poller is None:
            self._http = httpx.AsyncClient(timeout=5)
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        # A replica's first state before its first request, so that request lands by residency.
        workers = [self._worker(r) for r in candidate_replicas]
        new = [w for w in workers if not w.polled_at and not w.failures]
        if new:
            await asyncio.gather(*(self._poll(w) for w in new))
        model = (
            pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        ) or None
        by_url = {self._worker(r).url: r for r in candidate_replicas}
        prompt = self._prompt(pending_request, model)
        now = time.monotonic()
        views = [self._view(r.replica_id, now, prompt) for r in candidate_replicas]
        wanted = Wanted(model, None, prompt=prompt)
        placed = tuple(w.url for w in workers if model and placed_here(w, model))
        pick = among(self.picker, views, placed, wanted, "placed") if placed else None
        pick = pick or self.picker.pick(views, model)
        if not pick.ranking:  # no worker answered its last poll: let Ray try them all
            return [candidate_replicas]
        if pending_request is not None:  # counted at once, so that a burst picked together spreads
            self._count(pending_request, by_url[pick.ranking[0]].replica_id)
        return [[by_url[url]] for url in pick.ranking]

    def _count(self, pending_request: PendingRequest, replica: ReplicaID) -> None:
        """The request counts as in flight at `replica` (and no longer where an earlier pick placed
        it)."""
        request_id = pending_request.metadata.internal_request_id
        before = self._requests.get(request_id)
        if before == replica:
            return
        if before is not None:
            self.in_flight[before] = max(0, self.in_flight[before] - 1)
        self._requests[request_id] = replica
        self.in_flight[replica] += 1
        model = pending_request.metadata.multiplexed_model_id
        if replica in self.workers:
            if model:
                self.workers[replica].sent.add(model)
            self.workers[replica].prefixes.add(self._prompts.get(request_id, ()))

    def _prompt(self, pending_request: PendingRequest | None, model: str | None) -> tuple[int, ...]:
        """The hash chain of the request's prompt blocks, keyed by its adapter revision's digest
        (`loraplex.router.prefixes`); none without prefix scoring or a prompt to read."""
        if not self.prefix_blocks or pending_request is None:
            return ()
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self._prompts:
            body = next((a for a in pending_request.args if isinstance(a, dict)), None)
            if self._catalog is None and self.registry_url:
                self._catalog = registry_catalog(open_existing(self.registry_url))
            salt = prefix_key(self._catalog, Wanted(model, None))
            self._prompts[request_id] = block_hashes(prompt_text(body), salt) if body else ()
        return self._prompts[request_id]

    def _worker(self, replica: RunningReplica) -> Worker:
        worker = self.workers.get(replica.replica_id)
        if worker is None:
            url = replica.replica_metadata.get("worker_url", replica.replica_id.unique_id)
            prefixes = PrefixIndex(self.prefix_blocks)
            worker = Worker(url, healthy=False, pool=self.pool, prefixes=prefixes)
            self.workers[replica.replica_id] = worker
        return worker

    def _view(self, replica: ReplicaID, now: float, prompt: tuple[int, ...] = ()) -> WorkerView:
        """The last polled state, with this router's requests in flight there (a replica's own queue
        counts other routers' requests too, this router's count is newer) and the adapters sent
        there since: a worker takes a request's adapter into a device slot when it admits it, so
        with a slot free they count as in one, else as loading."""
        worker = self.workers[replica]
        last = worker.last or WorkerView(worker.url)
        fresh = now - worker.polled_at <= self.stale_s
        # A state read before this router's last request there ended still counts that
        # request's load.
        current = fresh and worker.polled_at >= self.completed_at.get(replica, 0.0)
        busy = last.waiting + last.running if current else 0
        in_slot = frozenset(worker.sent) if last.free_slots > 0 else frozenset()
        return dataclasses.replace(
            last,
            healthy=worker.healthy and worker.problem is None and worker.drain is None,
            fresh=fresh,
            waiting=0,
            running=0,
            in_flight=max(self.in_flight[replica], busy),
            active_tokens=last.active_tokens if current else 0,
            gpu=last.gpu | in_slot,
            loading=last.loading | (worker.sent - in_slot),
            prefix=worker.prefixes.match(prompt) if prompt else 0.0,
        )

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.poll_s)

    async def _poll(self, worker: Worker) -> None:
        sent = set(worker.sent)  # what the answer will already hold
        asked_at = time.monotonic()
        # the routing view by generation, as `loraplex router` polls it: 304 when nothing changed
        params, headers = {"view": "routing"}, self.headers
        if worker.generation is not None:
            params["since"] = worker.generation
            headers = {**headers, "If-None-Match": f'"{worker.generation}"'}
        try:
            response = await self._http.get(
                f"{worker.url}/admin/state", headers=headers, params=params
            )
            if response.status_code != 304:  # 304: the view held is the worker's
                response.raise_for_status()
            state = None if response.status_code == 304 else response.json()
        except (httpx.HTTPError, ValueError) as exc:
            worker.failures += 1
            if worker.healthy:
                log.warning("replica worker %s marked out: %s", worker.url, exc)
            worker.healthy = False
            return
        if state is not None:
            if "reset" in state:
                worker.apply_routing(state)
            else:  # a worker that answers the whole state whatever is asked
                worker.apply_state(state)
        worker.polled_at, worker.healthy = asked_at, not worker.draining
        worker.sent -= sent

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result
    ) -> None:
        self._count(pending_request, replica_id)  # Ray may have sent it past the first rank

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._prompts.pop(internal_request_id, None)
        if self._requests.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)
            self.completed_at[replica_id] = time.monotonic()

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.workers.pop(replica_id, None)
        self.in_flight.pop(replica_id, None)


def deployment(
    options: ServeSettings,
    num_replicas: int = 2,
    max_ongoing_requests: int = 64,
    policy: str = "affinity",
    max_waiting: int = 5,
    num_cpus: float = 0,
    admin_token: str | None = None,
    name: str = "loraplex",
    pool: PoolSpec | None = None,
):
    """The Ray Serve application of loraplex workers routed by LoraplexRequestRouter, for
    `serve.run`. The workers' admin token (one for all, which the router polls with) is made here
    unless given. `pool`: the declaration the replicas' workers are checked against (a pool of
    `run_pools`)."""
    token = admin_token or secrets.token_urlsafe(24)
    # Ray takes the router's arguments as JSON: the pool in its `--config` form.
    declared = None if pool is None else pool.as_dict()
    kwargs = {"admin_token": token, "policy": policy, "max_waiting": max_waiting, "pool": declared}
    router = RequestRouterConfig(
        request_router_class=LoraplexRequestRouter,
        request_router_kwargs={**kwargs, "registry_url": options.registry_url},
    )
    # A replica that does not match its pool fails the same way each time: once is enough.
    retries = {} if pool is None else {"max_constructor_retry_count": 1}
    return (
        serve.deployment(LoraplexReplica, name=name)
        .options(
            num_replicas=num_replicas,
            max_ongoing_requests=max_ongoing_requests,
            request_router_config=router,
            ray_actor_options={"num_cpus": num_cpus},
            **retries,
        )
        .bind(options, token, pool)
    )


@dataclasses.dataclass(frozen=True)
class RayPool:
    """A pool as a Ray Serve deployment of its own: its workers' settings (`options.model` its
    base model, `options.max_lora_rank` its max rank), its replicas, the tenants it is dedicated
    to (none: shared) and its role (`warm`, `canary` or none), which `ray_router` routes by.
    `base_model_digest`: the digest its workers must report (None: `options.model`'s own)."""

    name: str
    options: ServeSettings
    num_replicas: int = 2
    tenants: tuple[str, ...] = ()
    role: str | None = None
    base_model_digest: str | None = None


def pool_spec(pool: RayPool) -> PoolSpec:
    """The pool as the router declares one: its workers' served base model, the base model's
    digest (given, else read from the model directory when it is here to read), its max rank,
    its tenants and its role."""
    options = pool.options
    model = Path(options.model)
    digest = pool.base_model_digest
    if digest is None:
        try:
            digest = base_model_digest(model)
        except OSError:  # a model directory only the replicas' nodes hold: the name is checked
            digest = None
    return PoolSpec(
        pool.name,
        base_model=options.served_model_name or model.resolve().name,
        base_model_digest=digest,
        max_rank=options.max_lora_rank,
        tenants=pool.tenants,
        role=pool.role,
    )


def run_pools(
    pools: list[RayPool], admin_token: str | None = None, **kwargs: Any
) -> dict[str, DeploymentHandle]:
    """Each pool one Serve application and deployment, both named after it, routed inside by
    LoraplexRequestRouter and its replicas checked against the pool's declaration: pool name ->
    its handle. `kwargs` go to `deployment` for every pool."""
    names = [pool.name for pool in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pool names {names}: give each pool its own")
    token = admin_token or secrets.token_urlsafe(24)
    handles = {}
    for pool in pools:
        app = deployment(
            pool.options,
            pool.num_replicas,
            admin_token=token,
            name=pool.name,
            pool=pool_spec(pool),
            **kwargs,
        )
        try:
            handles[pool.name] = serve.run(app, name=pool.name, route_prefix=None)
        except RuntimeError as exc:  # Ray's line names no reason: the deployment's status does
            raise RuntimeError(f"{exc} {_failure(pool.name)}") from exc
    return handles


def _failure(name: str) -> str:
    """Why the deployment `name` of the application `name` failed, as Serve's status says."""
    app = serve.status().applications.get(name)
    deployment = app.deployments.get(name) if app is not None else None
    return deployment.message if deployment is not None else ""
