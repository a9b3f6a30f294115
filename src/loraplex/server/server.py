"""The `Server`: everything a request needs (tenancy, resolution, admission, generation, metrics,
audit) over one engine, and the views /admin/state and the metrics read."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from loraplex.artifacts import AllowList
from loraplex.engines.contract import Engine
from loraplex.registry import AdapterNotFound, Registry, RegistryError
from loraplex.registry.catalog import Catalog
from loraplex.registry.changes import Changed, ChangeWatcher
from loraplex.registry.records import TenantRecord
from loraplex.registry.traffic import gateway_model
from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.errors import ArtifactCorrupt
from loraplex.residency.events import Event, LoadFailed, LoadStage, PinRefused
from loraplex.residency.key import AdapterKey
from loraplex.server.adapters import AdapterResolver, Target
from loraplex.server.admission import Admission, Admitted
from loraplex.server.audit import AuditLog
from loraplex.server.auth import Authenticator
from loraplex.server.config import ServerConfig
from loraplex.server.disconnect import ClientGone, until_gone
from loraplex.server.errors import APIError
from loraplex.server.listing import ModelListing
from loraplex.server.loop_lag import LoopLag
from loraplex.server.metrics import ServerMetrics
from loraplex.server.middleware import CLIENT_CLOSED, RequestContext
from loraplex.server.pause import GenerationPause
from loraplex.server.pins import PinReconciler
from loraplex.server.placement import WorkerPlacement
from loraplex.server.retiring import HeldCollector, RetiredRevisions, RetiredTally
from loraplex.server.revision_figures import RevisionBook, RevisionCollector

log = logging.getLogger("loraplex.server")
QUARANTINE_REASON = "its bytes failed their digest check on load; the server log has the details"
T = TypeVar("T")


class Server:
    """Everything a request needs, kept on the app (`app.state.server`)."""

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        config: ServerConfig,
        api_keys: dict[str, str] | None = None,
    ):
        self.engine = engine
        self.registry = registry
        self.config = config
        settings = config.settings
        self.auth = Authenticator(registry, api_keys, ttl_s=settings.key_cache_ttl_s)
        self.tenants: dict[str, TenantRecord] = {}
        """The registry's tenants (priority, request limits), read again when it changes."""
        self.catalog = Catalog(registry)
        """The registry's adapters in memory, kept current by its change feed (`feed`)."""
        self.feed = ChangeWatcher(registry.engine, self.catalog.refresh)
        self.catalog.subscribe(self.on_registry_change)
        self.resolver = AdapterResolver(
            registry,
            self.catalog,
            engine.base_model_digest,
            config.served_model_name,
            self.tenant_priority,
            registry.registration.trusted_keys,
        )
        self.listing = ModelListing(
            self.catalog,
            config.served_model_name,
            self.resolver.may_see,
            self.resolver.draining,
            lambda: engine.max_model_len,
        )
        """`/v1/models`, from the catalog."""
        self.admission = Admission(settings.max_waiting, settings.max_requests_per_tenant)
        self.pause = GenerationPause()
        """vLLM's `/pause`: new generation requests wait for the `/resume`."""
        self.revision_figures = RevisionBook()
        """Per-revision figures of the names in a split, for rollout controllers."""
        self.metrics = self._metrics()
        self.loop_lag = LoopLag(self.metrics.loop_lag)
        self.audit = AuditLog(config.audit_log)
        self.allowed = AllowList.parse(list(settings.allowed_roots))
        self.max_prompt_tokens = settings.max_prompt_tokens or engine.max_model_len - 1
        self.is_started = False
        """The engine has started: requests are taken."""
        self.is_draining = False
        self.placement = WorkerPlacement()
        """The names the placement controller keeps warm here, and its drain."""
        self.load_stages: dict[
            str, dict[str, float]
        ] = {}  # str(key) -> {stage: ms} of its last load
        self.pins = PinReconciler(
            registry, self.catalog, self.resolver, engine.adapters, settings.registry_watch_s
        )
        self.retired = RetiredRevisions(
            self.catalog,
            engine.adapters,
            self.pins,
            lambda key: self.metrics.retired_unloads.inc(),
        )
        """Unloads the revisions the registry retires."""
        engine.adapters.on_event = self.on_cache_event
        self.engine_ids = random.Random()
        """The engine's request ids (the event loop's: a `random.Random` is not shared safely)."""
        # A registry write waits on the database: never on the step thread or the event loop.
        self.registry_writer = ThreadPoolExecutor(1, thread_name_prefix="registry-write")

    def _metrics(self) -> ServerMetrics:
        """The server's series, with the collectors that read the revisions' figures, the
        revisions held per name and the retirements the catalog sees."""
        settings = self.config.settings
        metrics = ServerMetrics(
            self.live_figures,
            settings.top_k_adapter_metrics,
            settings.lora_load_state_metrics,
            self.adapter_rank,
        )
        metrics.registry.register(RevisionCollector(self.revision_figures))
        metrics.registry.register(HeldCollector(self.catalog, self.engine.adapters))
        self.catalog.subscribe(RetiredTally(self.catalog, metrics.revisions_retired.inc))
        return metrics

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """On the event loop, before the first request."""
        self.catalog.refresh()  # the whole catalog, once (its listener reads the tenants)
        # what was just read lives as long as the process: the collector's full passes, which
        # stop every thread, need not walk it (100,000 adapters: hundreds of ms a pass)
        gc.freeze()
        # every card now, before any stream: a first listing that made them would grow the cards'
        # dicts past 2/3 full, and a resize of 100,000 names holds the loop for about 10 ms
        self.listing.prepare(self.catalog.names)
        await self.engine.start()
        self.is_started = True
        try:
            self.apply_budgets()
        except Exception:  # a registry briefly unreachable: the watcher applies them later
            log.exception("could not read the tenants' residency budgets")
        try:
            self.pins.warm_start()
        except Exception:  # serving cold is better than not serving
            log.exception("warm start failed; adapters will load on demand")
        self.pins.start()
        self.feed.start()
        self.loop_lag.start()

    def begin_shutdown(self) -> None:
        """Stop admitting (503); requests in flight go on."""
        if not self.is_draining:
            log.info("shutting down: no new requests, finishing those in flight")
        self.is_draining = True
        self.pause.resume()  # requests held by a pause are answered (503) rather than left waiting

    def stop(self) -> None:
        self.loop_lag.stop()
        self.feed.stop()
        self.pins.stop()
        self.retired.stop()
        self.begin_shutdown()
        if self.is_started:
            self.engine.stop()
        self.registry_writer.shutdown(wait=True)
        self.audit.close()

    def follow_traffic(self) -> None:
        """Apply the registry's changes now (what the change feed does at the next commit): the
        catalog, the pins that follow traffic, the tenants."""
        self.catalog.refresh()
        self.pins.follow([])  # the grace pins whose period ended

    def on_registry_change(self, changed: Changed) -> None:
        """The catalog applied a change (made here or elsewhere): the pins follow the adapters it
        touched; the tenants, and the keys' cache, are read again when theirs changed."""
        if changed.tenants:
            self.read_tenants()
            try:
                self.apply_budgets()
            except Exception:  # before start, or a budget the engine refuses: logged, serving on
                log.exception("could not apply the tenants' residency budgets")
        if changed.keys:
            self.auth.forget()
        if self.is_started:  # after start: warm_start pins the whole catalog
            self.pins.follow(changed.adapters)
            self.retired.follow(changed.adapters)
        if changed.adapters:  # their /v1/models cards, on this thread rather than a listing's
            self.listing.prepare(changed.adapters)

    def read_tenants(self) -> None:
        self.tenants = {t.name: t for t in self.registry.list_tenants()}

    def tenant_priority(self, tenant: str) -> int:
        """The tenant's registry priority: keep_score's tenant term for adapters it brings in."""
        record = self.tenants.get(tenant)
        return record.priority if record is not None else 0

    def admit(self, tenant: str):
        """An admission ticket within the tenant's request limits (its own, else the server's)."""
        limits = self.tenants.get(tenant)
        if limits is None:
            return self.admission.admit(tenant, None, None)
        return self.admission.admit(tenant, limits.max_concurrent_requests, limits.max_waiting)

    def budgets_from(self, tenants) -> TenantBudgets:
        """This server's budgets for the registry's tenants (`TenantRecord`s), on the engine's
        capacity and default shares. Raises ValueError naming the field for a budget beyond this
        server's capacity."""
        own = {
            t.name: Budget(t.max_gpu_slots, t.max_cpu_bytes)
            for t in tenants
            if t.max_gpu_slots is not None or t.max_cpu_bytes is not None
        }
        return dataclasses.replace(self.engine.adapters.budgets, tenants=own)

    def apply_budgets(self) -> None:
        """The tenants' residency budgets from the registry, onto the engine's adapters (either
        engine). A budget beyond this server's capacity (the registry serves workers of several
        sizes) is capped at the capacity here, and logged."""
        cache = self.engine.adapters
        capacity = cache.budgets
        tenants = self.registry.list_tenants()
        try:
            budgets = self.budgets_from(tenants)
        except ValueError as exc:
            log.warning("residency budgets: %s; capped at this server's capacity", exc)
            capped = [
                dataclasses.replace(
                    t,
                    max_gpu_slots=_cap(t.max_gpu_slots, capacity.gpu_slots),
                    max_cpu_bytes=_cap(t.max_cpu_bytes, capacity.cpu_bytes),
                )
                for t in tenants
            ]
            budgets = self.budgets_from(capped)
        if budgets != cache.budgets:
            cache.set_budgets(budgets)

    def check_accepting(self) -> None:
        if self.is_draining or not self.is_started:
            raise APIError(
                503, "The server is shutting down; retry on another worker.", "shutting_down"
            )
        if not self.engine_alive():
            raise APIError(
                503, "The engine has stopped; retry on another worker.", "engine_unavailable"
            )

    def engine_alive(self) -> bool:
        return self.engine.is_alive

    # -- request steps ---------------------------------------------------------------------------
    async def resolve(self, ctx: RequestContext, model: str, user: str | None) -> Target:
        assert ctx.tenant is not None  # authenticated first
        start = time.perf_counter()
        try:
            await self.catalog.current()  # this process's own commits applied (no query)
            record = self.resolver.record_for(ctx.tenant, model, user)
            if record is None:
                target = self.resolver.base
            else:
                await self.resolver.prepare(record)  # a digest's first request: off the loop
                target = self.resolver.target(record, ctx.tenant)
        except AdapterNotFound:
            # Counted for another tenant's name and for an unknown one alike: the 404s are the same,
            # and so is the count, or /metrics would tell a tenant which private names exist.
            ctx.denied = True
            raise
        ctx.adapter, ctx.digest = target.label, target.digest
        if target.ref is None:
            ctx.tier = "gpu"
        else:
            # the first stage of an adapter's path to a slot: name → revision → key (the registry,
            # maybe its files)
            ctx.audit["resolve_s"] = time.perf_counter() - start
            self.metrics.on_cache_event(LoadStage("resolve", ctx.audit["resolve_s"]))
            assert target.record is not None  # an adapter's target has its revision
            ctx.adapter_name, ctx.revision, ctx.rank = (
                target.record.name,
                target.record.revision,
                target.record.rank,
            )
            ctx.in_split = 0 < target.record.traffic_weight < 100
            ctx.tier = self.tier_on_arrival(target)
        return target

    def tier_on_arrival(self, target: Target) -> str:
        assert target.ref is not None  # an adapter's target
        tier = self.engine.adapters.tier_of(target.ref.key)
        # The cache learns a key's local path at the request's first acquire; the bytes are on disk
        # already.
        return "disk" if tier == "remote" and target.ref.path is not None else tier

    def admit_request(self, ctx: RequestContext, target: Target) -> Admitted:
        """The request admitted within its tenant's limits (else 429), its target counted in
        use."""
        assert ctx.tenant is not None  # authenticated first
        try:
            ticket = self.admit(ctx.tenant)
        except APIError as exc:
            ctx.denied = exc.code == "tenant_quota_exceeded"
            raise
        return Admitted(ticket, self.engine, self.resolver, ctx, target)

    async def run(
        self, admitted: Admitted, gone: asyncio.Future, start: Callable[[], Awaitable[T]]
    ) -> T | None:
        """The admitted request's adapter acquired from the engine, then its run started (`start`:
        the request layer's); None when `gone` (the client left) ends first: the request is then
        finished, and recorded as the client's leaving. Any error finishes it too."""
        try:
            await until_gone(admitted.acquire(), gone)
            # the engine's error (bad request, adapter unavailable) is the answer; a client gone
            # stops the run, leaving the queue, no load waited for
            return await until_gone(start(), gone)
        except ClientGone:
            admitted.ctx.status = CLIENT_CLOSED
            admitted.finish()
            return None
        except BaseException:
            admitted.finish()
            raise

    def finish_request(self, ctx: RequestContext, status: int) -> None:
        """The middleware's last call for each inference request: metrics and the audit line."""
        a = ctx.audit
        self.metrics.on_request(
            ctx.tenant or "unauthenticated",
            status,
            ctx.adapter_name,
            ctx.tier or None,
            ctx.denied,
            a.get("completion_tokens") or 0,
            ctx.rank,
        )
        if ctx.tier:
            self.metrics.on_timings(
                ctx.tier, a.get("ttft_s"), a.get("tpot_s"), a.get("queue_wait_s")
            )
        if ctx.adapter_name and ctx.revision:
            self.revision_figures.record(
                ctx.adapter_name,
                ctx.revision,
                ctx.in_split,
                status,
                a.get("ttft_s"),
                a.get("tpot_s"),
            )
        load_ms: dict[str, float | None] | None = None
        if (
            ctx.tier in _TIER_STAGES and ctx.adapter_name
        ):  # the stages this request's tier went through, not older ones
            stages = self.load_stages.get(ctx.adapter, {})
            load_ms = {k: v for k, v in stages.items() if k in _TIER_STAGES[ctx.tier]} or None
            if (
                load_ms is not None and a.get("resolve_s") is not None
            ):  # this request's own first stage
                load_ms = {"resolve": _ms(a["resolve_s"]), **load_ms}
        self.audit.write(
            {
                "ts": round(time.time(), 3),
                "request_id": ctx.request_id,
                "endpoint": ctx.endpoint,
                "tenant": ctx.tenant,
                "base_model": self.config.served_model_name,
                "adapter": ctx.adapter_name,
                "revision": ctx.revision,
                "digest": ctx.digest or None,
                "rank": ctx.rank,
                "cache_tier": ctx.tier or None,
                "queue_wait_ms": _ms(a.get("queue_wait_s")),
                "load_ms": load_ms,
                "ttft_ms": _ms(a.get("ttft_s")),
                "tpot_ms": _ms(a.get("tpot_s")),
                "prompt_tokens": a.get("prompt_tokens"),
                "completion_tokens": a.get("completion_tokens"),
                "finish_reason": a.get("finish_reason"),
                "status": status,
                "error_code": ctx.error_code,
            }
        )

    def on_cache_event(self, event: Event) -> None:
        self.metrics.on_cache_event(event)
        match event:
            case LoadStage(stage, seconds, key) if key is not None:
                if stage == "disk":  # a new load (its download, if any, is reported right after)
                    self.load_stages[str(key)] = {}
                stages = self.load_stages.setdefault(str(key), {})
                stages[stage] = round(seconds * 1000, 3)
            case LoadFailed(key, _, exception):
                log.warning("load of %s failed: %s", key, exception)
                if isinstance(exception, ArtifactCorrupt):
                    self.registry_writer.submit(self.quarantine_corrupt, key, exception)
            case PinRefused(error=error):
                log.warning("%s", error)

    def quarantine_corrupt(self, key: AdapterKey, error: Exception) -> None:
        """A revision whose bytes fail their digest is never served again; its traffic returns to
        the stable. The reason recorded is the same for every revision (tenants see it in the 404
        for `name@revision`): the error names the store's paths or URLs, so it goes to the server
        log only."""
        try:
            self.registry.quarantine(key.name, key.revision, QUARANTINE_REASON)
            log.error("quarantined %s@%s: %s", key.name, key.revision, error)
        except RegistryError as exc:  # already quarantined, or removed meanwhile
            log.warning("could not quarantine %s@%s: %s", key.name, key.revision, exc)
        except Exception:  # the database unreachable: the next failed load tries again
            log.exception("could not quarantine %s@%s", key.name, key.revision)

    # -- views -----------------------------------------------------------------------------------
    def live_figures(self) -> dict:
        """The engine's figures, with adapters named as a gateway routes them (`gateway_model`)."""
        live = self.engine.live_figures()
        serving = self.pins.serving
        for a in live["cache"]["adapters"]:
            a["model"] = gateway_model(a["name"], a["revision"], serving.get(a["name"]))
        on_gpu = sorted({a["model"] for a in live["cache"]["adapters"] if a["tier"] == "gpu"})
        waiting = {
            gateway_model(k.name, k.revision, serving.get(k.name)) for k in live.pop("waiting_keys")
        }
        return {
            **live,
            "running_adapters": on_gpu,
            "waiting_adapters": sorted(waiting - set(on_gpu)),
            "engine_alive": self.engine_alive(),
        }

    def adapter_rank(self, name: str, revision: str) -> int | None:
        adapter = self.catalog.adapter(name)
        revisions = adapter.revisions if adapter is not None else ()
        return next((r.rank for r in revisions if r.revision == revision), None)

    def state(self) -> dict:
        """GET /admin/state: residency of every adapter and the load figures the router needs."""
        live = self.live_figures()
        cache = live["cache"]
        return {
            "base_model": self.config.served_model_name,
            "base_model_digest": self.engine.base_model_digest,
            "max_lora_rank": live["max_lora_rank"],
            "max_loras": live["max_loras"],
            "draining": self.is_draining,
            **self.placement.state(self.admission.num_in_flight),
            "adapters": cache["adapters"],
            "load": {
                "waiting": live["num_waiting"],
                "running": live["num_running"],
                "max_num_seqs": self.config.settings.max_num_seqs,
                "active_tokens": live["active_tokens"],
                "recent_evictions": cache["recent_evictions"],
                "free_slots": cache["free_slots"],
                "num_slots": cache["num_slots"],
                "kv_cache_usage": live["kv_cache_usage"],
                "admitted_waiting": self.admission.num_waiting,
                "in_flight": self.admission.num_in_flight,
            },
            # Per tenant: the slots and host bytes charged to it against its budget (None: none).
            "tenants": cache.get("tenants", {}),
            "cache": {k: v for k, v in cache.items() if k not in ("adapters", "tenants")},
        }


_TIER_STAGES = {
    "cpu": {"h2d", "activation"},
    "disk": {"disk", "h2d", "activation"},
    "remote": {"download", "disk", "h2d", "activation"},
}


def _cap(value: int | None, capacity: int) -> int | None:
    return None if value is None else min(value, capacity)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
