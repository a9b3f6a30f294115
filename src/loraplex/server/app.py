"""The FastAPI application: `create_app(engine, registry, config)` wires the OpenAI API, the admin API,
health, readiness and metrics around one engine. The app owns the engine from then on (it stops it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sequence import SamplingParams
from loraplex.cache.errors import ArtifactCorrupt, CapacityExceeded
from loraplex.cache.key import AdapterKey
from loraplex.registry import AdapterNotFound, AdapterRecord, AllowList, Registry, RegistryError
from loraplex.registry.traffic import gateway_model
from loraplex.server import admin, openai_api
from loraplex.server.admission import Admission
from loraplex.server.adapters import AdapterResolver, Target
from loraplex.server.audit import AuditLog
from loraplex.server.auth import Authenticator, check_token
from loraplex.server.errors import APIError, install_handlers
from loraplex.server.generation import Generation
from loraplex.server.metrics import ServerMetrics
from loraplex.server.middleware import CLIENT_CLOSED, RequestContext, RequestMiddleware
from loraplex.server.schemas import model_card

log = logging.getLogger("loraplex.server")
QUARANTINE_REASON = "its bytes failed their digest check on load; the server log has the details"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    """The base model's name in `model` fields and /v1/models."""
    admin_token: str | None = None
    """Bearer token of the admin API; None turns the admin API off (its paths answer 404)."""
    admin_on_main_app: bool = True
    """False when the admin API is served on its own port (`create_admin_app`)."""
    allowed_roots: tuple[str, ...] = ()
    """Directories (and URL prefixes) the admin API may register adapters from."""
    audit_log: str | Path | None = None
    """JSONL file, `-` for stdout, None for none."""
    max_waiting: int = 512
    """Requests admitted but without a first token yet; beyond this, 429 with Retry-After."""
    max_requests_per_tenant: int | None = 256
    """Requests in flight per tenant; beyond this, 429 with Retry-After (None: no limit)."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted (default: the engine's max_model_len - 1)."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body (413 beyond)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long requests in flight may take to finish before they are aborted."""
    unload_timeout_s: float = 60.0
    """How long an unload waits for the adapter's requests in flight."""
    top_k_adapter_metrics: int = 0
    """Per-adapter request counts for the K busiest adapters in /metrics (0: none)."""
    lora_load_state_metrics: int = 0
    """Residency series (`vllm:lora_adapter_loaded`, ...) of the K best-placed adapters (0: off)."""
    metrics_token: str | None = None
    """When set, /metrics answers only `Authorization: Bearer <token>` (it names running adapters and tenants)."""
    key_cache_ttl_s: float = 5.0
    """How long a registry API key lookup is trusted (revocations take effect within this)."""
    registry_watch_s: float = 2.0
    """How often the server looks for traffic changes made elsewhere (the registry CLI) to move pins along."""

    def __post_init__(self):
        if self.max_waiting < 0 or (self.max_requests_per_tenant is not None and self.max_requests_per_tenant < 1):
            raise ValueError("max_waiting must be >= 0 and max_requests_per_tenant >= 1")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ValueError("the metrics token must be at least 16 characters")


class Server:
    """Everything a request needs, kept on the app (`app.state.server`)."""

    def __init__(self, engine: LLMEngine, registry: Registry, config: ServerConfig,
                 api_keys: dict[str, str] | None = None):
        self.engine = engine
        self.registry = registry
        self.config = config
        self.auth = Authenticator(registry, api_keys, ttl_s=config.key_cache_ttl_s)
        self.resolver = AdapterResolver(registry, engine.base_model_digest, config.served_model_name)
        self.admission = Admission(config.max_waiting, config.max_requests_per_tenant)
        self.metrics = ServerMetrics(self.live_figures, config.top_k_adapter_metrics,
                                     config.lora_load_state_metrics, self.adapter_rank)
        self.audit = AuditLog(config.audit_log)
        self.allowed = AllowList.parse(list(config.allowed_roots))
        self.max_prompt_tokens = config.max_prompt_tokens or engine.max_model_len - 1
        self.async_engine: AsyncEngine | None = None
        self.is_draining = False
        self.load_stages: dict[str, dict[str, float]] = {}  # str(key) -> {stage: ms} of its last load
        # Pins that follow traffic (`follow_traffic`): those a name's pin or warm policy made, the revisions that
        # left traffic kept in host memory for the grace period, and each name's serving revisions at the last look.
        self._rule_pins: dict[AdapterKey, str] = {}
        self._grace_pins: dict[AdapterKey, float] = {}  # key -> time.monotonic() its grace period ends
        self._operator_pins: set[AdapterKey] = set()  # pinned by revision through the admin API
        self._serving: dict[str, frozenset[str]] = {}
        self._rule_tiers: dict[str, str | None] = {}  # each name's pin tier (its pin, else warm policy) at the last look
        self._pins_lock = threading.RLock()
        self._watch_stop = threading.Event()
        engine.adapters.on_event = self.on_cache_event

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.async_engine = AsyncEngine(self.engine)
        try:
            self.warm_start()
        except Exception:  # serving cold is better than not serving
            log.exception("warm start failed; adapters will load on demand")
        threading.Thread(target=self._watch_registry, name="registry-watch", daemon=True).start()

    def begin_shutdown(self) -> None:
        """Stop admitting (503); requests in flight go on."""
        if not self.is_draining:
            log.info("shutting down: no new requests, finishing those in flight")
        self.is_draining = True

    def stop(self) -> None:
        self._watch_stop.set()
        self.begin_shutdown()
        if self.async_engine is not None:
            self.async_engine.stop()
        self.audit.close()

    def warm_start(self) -> None:
        """Pins and warm policies from the registry: load those adapters before traffic asks for them."""
        for adapter in self.registry.list_adapters():
            self.warm(adapter)

    def warm(self, adapter: AdapterRecord) -> None:
        """Bring the adapter's pins in line with its traffic. The revisions that left traffic since the last look
        lose the pins its rule made, and a resident one is kept in host memory for the registry's grace period (a
        rollback finds it warm; ARCHITECTURE: "the old revision stays resident for a grace period"). The serving
        revisions are pinned when the adapter is pinned, in the tier of its pin, or else has a warm policy of gpu or
        cpu, in that tier (the operator's pin overrides the manifest's policy). A pin one revision got from an
        operator (`operator_pinned`) is theirs: neither made nor dropped here, until the name is unpinned. When the
        name is unpinned, the serving revisions lose the pins its rule made, and a revision serving again gives up its
        grace pin. A pin that cannot be made (beyond capacity, a failed load) is logged and serving goes on; the
        revision loses the pin of the name's previous tier."""
        tier = _rule_tier(adapter)
        cache, serving = self.engine.adapters, _serving_revisions(adapter)
        owner = adapter.owner_tenant or "default"
        with self._pins_lock:
            before = self._serving.get(adapter.name)
            self._serving[adapter.name] = serving
            if tier is None and self._rule_tiers.get(adapter.name) is not None:  # unpinned (elsewhere too)
                mine = [k for k in self._operator_pins if k.name == adapter.name]
                for key in mine:
                    cache.unpin(key)
                self.released(mine)
            self._rule_tiers[adapter.name] = tier
            for record in adapter.revisions:
                if not self.resolver.may_see(record.base_model_digest):
                    continue
                if before is not None and record.revision in before and record.revision not in serving:
                    self._retire(self.resolver.ref_for(record, owner), record.status != "quarantined")
            if tier is None and not any(k.name == adapter.name for k in (*self._rule_pins, *self._grace_pins)):
                return  # no rule and no pin of its to drop
            for record in adapter.revisions:
                if record.traffic_weight and self.resolver.may_see(record.base_model_digest):
                    ref = self.resolver.ref_for(record, owner)
                    if ref.key in self._operator_pins:
                        continue
                    if tier is None:  # no rule (any more): traffic keeps it resident, not a pin
                        made = self._rule_pins.pop(ref.key, None)
                        if self._grace_pins.pop(ref.key, None) is not None:
                            made = made or "cpu"
                        if made is not None and getattr(cache.entries.get(ref.key), "pinned", None) == made:
                            cache.unpin(ref.key)
                        continue
                    self._grace_pins.pop(ref.key, None)  # serving again: the rule's pin replaces the grace one
                    try:
                        cache.pin(ref, tier)
                    except Exception as exc:  # a warm start that cannot happen must not stop serving
                        log.warning("could not pin %s in %s: %s", record.model_id, tier, exc)
                        old = self._rule_pins.pop(ref.key, None)  # nor keep the pin of the name's previous tier
                        if old is not None and getattr(cache.entries.get(ref.key), "pinned", None) == old:
                            cache.unpin(ref.key)
                        continue
                    self._rule_pins[ref.key] = tier

    def _retire(self, ref, keep_warm: bool) -> None:
        """A revision left traffic: drop its rule's pin; keep it in host memory for the grace period if resident."""
        cache, key = self.engine.adapters, ref.key
        if key in self._operator_pins:
            return
        tier = self._rule_pins.pop(key, None)
        if tier is not None and getattr(cache.entries.get(key), "pinned", None) == tier:
            cache.unpin(key)
        grace_s = self.registry.grace_period.total_seconds()
        if keep_warm and grace_s > 0 and cache.tier_of(key) in ("gpu", "cpu") \
                and getattr(cache.entries.get(key), "pinned", None) is None:
            try:
                cache.pin(ref, "cpu")
            except CapacityExceeded:
                return  # no room to keep it: it is evicted as any other copy
            self._grace_pins[key] = time.monotonic() + grace_s

    def follow_traffic(self) -> None:
        """Move pins along with traffic (`warm`) for every name whose serving revisions or pin changed since the last
        look (an admin call here, the registry CLI elsewhere, a quarantine); drop the grace pins whose period ended."""
        with self._pins_lock:
            self._end_grace()
            for adapter in self.registry.list_adapters():
                if self._serving.get(adapter.name) != _serving_revisions(adapter) \
                        or self._rule_tiers.get(adapter.name) != _rule_tier(adapter):
                    self.warm(adapter)

    def _end_grace(self) -> None:
        cache, now = self.engine.adapters, time.monotonic()
        with self._pins_lock:
            for key, until in list(self._grace_pins.items()):
                if until <= now:
                    del self._grace_pins[key]
                    if getattr(cache.entries.get(key), "pinned", None) == "cpu":
                        cache.unpin(key)

    def warm_name(self, name: str) -> None:
        """`warm` with the adapter read under the pins' lock, so that a call made for an admin request cannot apply
        an older reading after the watcher applied a newer one."""
        with self._pins_lock:
            self.warm(self.registry.show(name))

    def released(self, keys) -> None:
        """An operator unpinned or evicted these keys: no pin of theirs is kept or moved by traffic any more."""
        with self._pins_lock:
            for key in keys:
                self._rule_pins.pop(key, None)
                self._grace_pins.pop(key, None)
                self._operator_pins.discard(key)

    def operator_pinned(self, keys, name: str, tier: str) -> None:
        """An operator pinned these revisions of `name` themselves, in `tier`: traffic neither moves nor drops those
        pins. The registry records a pin of the name (what a start pins again), under the pins' lock: the watcher is
        not to take that record for a pin of the name's other serving revisions."""
        keys = list(keys)
        with self._pins_lock:
            self.registry.pin(name, True, tier)
            self.released(keys)
            self._operator_pins.update(keys)
            if self._rule_tiers.get(name) is None:
                self._rule_tiers[name] = tier

    def _watch_registry(self) -> None:
        seen = None
        while not self._watch_stop.wait(self.config.registry_watch_s):
            try:
                generation = self.registry.generation()
                if generation != seen:  # the whole registry is read only when it changed
                    self.follow_traffic()
                    seen = generation
                else:
                    self._end_grace()
            except Exception:  # a registry that is briefly unreachable: look again at the next turn
                if not self._watch_stop.is_set():  # (not the registry closed under a stopping server)
                    log.exception("could not follow the registry's traffic changes")

    def check_accepting(self) -> None:
        if self.is_draining or self.async_engine is None:
            raise APIError(503, "The server is shutting down; retry on another worker.", "shutting_down")

    # -- request steps ---------------------------------------------------------------------------
    def resolve(self, ctx: RequestContext, model: str, user: str | None) -> Target:
        start = time.perf_counter()
        try:
            target = self.resolver.resolve(ctx.tenant, model, user)
        except AdapterNotFound:
            # Counted for another tenant's name and for an unknown one alike: the 404s are the same, and so is the
            # count, or /metrics would tell a tenant which private names exist.
            ctx.denied = True
            raise
        ctx.adapter, ctx.digest = target.label, target.digest
        if target.ref is None:
            ctx.tier = "gpu"
        else:
            # the first stage of an adapter's path to a slot: name → revision → key (the registry, maybe its files)
            ctx.audit["resolve_s"] = time.perf_counter() - start
            self.metrics.on_cache_event("load_stage", {"stage": "resolve", "seconds": ctx.audit["resolve_s"]})
            ctx.adapter_name, ctx.revision, ctx.rank = target.record.name, target.record.revision, target.record.rank
            ctx.tier = self.tier_on_arrival(target)
        return target

    def tier_on_arrival(self, target: Target) -> str:
        tier = self.engine.adapters.tier_of(target.ref.key)
        # The cache learns a key's local path at the request's first acquire; the bytes are on disk already.
        return "disk" if tier == "remote" and target.ref.path is not None else tier

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        limit = self.max_prompt_tokens
        if isinstance(prompt, str):
            # Tokens are far shorter than 64 characters: a longer text cannot fit, so skip tokenizing it.
            if len(prompt) > 64 * limit:
                raise APIError(400, f"The prompt is longer than the limit of {limit} tokens (max_prompt_tokens).",
                               "prompt_too_long", "prompt")
            prompt = self.engine.tokenizer.encode(prompt)
        if not prompt:
            raise APIError(400, "The prompt is empty.", "invalid_value", "prompt")
        if len(prompt) > limit:
            raise APIError(400, f"The prompt has {len(prompt)} tokens, more than the limit of {limit} "
                           "(max_prompt_tokens).", "prompt_too_long", "prompt")
        return prompt

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.engine.tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", "messages") from None
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)  # the template adds them itself
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"The messages make a prompt of {len(ids)} tokens, more than the limit of "
                           f"{self.max_prompt_tokens} (max_prompt_tokens).", "prompt_too_long", "messages")
        return ids

    async def generate(self, ctx: RequestContext, target: Target, prompts: list[list[int]],
                       params: SamplingParams, gone: asyncio.Future) -> Generation | None:
        """The started generation (every prompt's first output in); None when `gone` (the client left) ends first:
        the generation is then closed, and the request recorded as the client's leaving."""
        try:
            ticket = self.admission.admit(ctx.tenant)
        except APIError as exc:
            ctx.denied = exc.code == "tenant_quota_exceeded"
            raise
        gen = Generation(self.async_engine, self.resolver, ctx, target, prompts, params, ticket)
        start = asyncio.ensure_future(gen.start())
        try:
            await asyncio.wait((start, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled: no start left running on its own
            if not start.done():  # start() closes the generation: the request leaves the queue, no load waited for
                start.cancel()
                await asyncio.gather(start, return_exceptions=True)
                ctx.status = CLIENT_CLOSED
        if start.cancelled():
            return None
        start.result()  # the engine's error (bad request, adapter unavailable) is the answer
        return gen

    def finish_request(self, ctx: RequestContext, status: int) -> None:
        """The middleware's last call for each inference request: metrics and the audit line."""
        a = ctx.audit
        self.metrics.on_request(ctx.tenant or "unauthenticated", status, ctx.adapter_name, ctx.tier or None,
                                ctx.denied)
        if ctx.tier:
            self.metrics.on_timings(ctx.tier, a.get("ttft_s"), a.get("tpot_s"), a.get("queue_wait_s"))
        load_ms = None
        if ctx.tier in _TIER_STAGES and ctx.adapter_name:  # the stages this request's tier went through, not older ones
            stages = self.load_stages.get(ctx.adapter, {})
            load_ms = {k: v for k, v in stages.items() if k in _TIER_STAGES[ctx.tier]} or None
            if load_ms is not None and a.get("resolve_s") is not None:  # this request's own first stage
                load_ms = {"resolve": _ms(a["resolve_s"]), **load_ms}
        self.audit.write({
            "ts": round(time.time(), 3), "request_id": ctx.request_id, "endpoint": ctx.endpoint,
            "tenant": ctx.tenant, "base_model": self.config.served_model_name, "adapter": ctx.adapter_name,
            "revision": ctx.revision, "digest": ctx.digest or None, "rank": ctx.rank, "cache_tier": ctx.tier or None,
            "queue_wait_ms": _ms(a.get("queue_wait_s")), "load_ms": load_ms, "ttft_ms": _ms(a.get("ttft_s")),
            "tpot_ms": _ms(a.get("tpot_s")), "prompt_tokens": a.get("prompt_tokens"),
            "completion_tokens": a.get("completion_tokens"), "finish_reason": a.get("finish_reason"),
            "status": status, "error_code": ctx.error_code,
        })

    def on_cache_event(self, kind: str, fields: dict) -> None:
        self.metrics.on_cache_event(kind, fields)
        if kind == "load_stage" and fields.get("key") is not None:
            if fields["stage"] == "disk":  # a new load (its download, if any, is reported right after)
                self.load_stages[str(fields["key"])] = {}
            stages = self.load_stages.setdefault(str(fields["key"]), {})
            stages[fields["stage"]] = round(fields["seconds"] * 1000, 3)
        if kind == "load_failed":
            log.warning("load of %s failed: %s", fields["key"], fields["exception"])
        if kind == "load_failed" and isinstance(fields.get("exception"), ArtifactCorrupt):
            self.quarantine_corrupt(fields["key"], fields["exception"])
        if kind == "pin_refused":
            log.warning("%s", fields["error"])

    def quarantine_corrupt(self, key: AdapterKey, error: Exception) -> None:
        """A revision whose bytes fail their digest is never served again; its traffic returns to the stable. The
        reason recorded is the same for every revision (tenants see it in the 404 for `name@revision`): the error
        names the store's paths or URLs, so it goes to the server log only."""
        try:
            self.registry.quarantine(key.name, key.revision, QUARANTINE_REASON)
            log.error("quarantined %s@%s: %s", key.name, key.revision, error)
        except RegistryError as exc:  # already quarantined, or removed meanwhile
            log.warning("could not quarantine %s@%s: %s", key.name, key.revision, exc)

    # -- views -----------------------------------------------------------------------------------
    def model_cards(self, tenant: str) -> list[dict]:
        name = self.config.served_model_name
        cards = [model_card(name, "loraplex", None)]
        for adapter in self.registry.list_adapters(tenant):
            serving = [r for r in adapter.revisions if r.traffic_weight and self.resolver.may_see(r.base_model_digest)]
            if serving and adapter.name not in self.resolver.draining:
                owner = "shared" if adapter.shared else adapter.owner_tenant or "shared"
                main = max(serving, key=lambda r: r.traffic_weight)
                cards.append(model_card(adapter.name, owner, name, root=main.model_id))
        return cards

    def live_figures(self) -> dict:
        cache = self.engine.adapters.state()
        scheduler = self.engine.scheduler
        running, waiting = list(scheduler.running), list(scheduler.waiting)
        for a in cache["adapters"]:  # the name a gateway routes this revision by
            a["model"] = gateway_model(a["name"], a["revision"], self._serving.get(a["name"]))
        on_gpu = sorted({a["model"] for a in cache["adapters"] if a["tier"] == "gpu"})
        keys = {s.adapter.key for s in waiting if s.adapter is not None}
        serving = self._serving.get
        waiting_names = {gateway_model(k.name, k.revision, serving(k.name)) for k in keys}
        return {
            "cache": cache, "num_running": len(running), "num_waiting": len(waiting),
            "active_tokens": sum(len(s) for s in running), "kv_cache_usage": self.engine.blocks.usage,
            "running_adapters": on_gpu, "waiting_adapters": sorted(waiting_names - set(on_gpu)),
            "max_lora": self.engine.config.max_loras,
        }

    def adapter_rank(self, name: str, revision: str) -> int | None:
        try:
            revisions = self.registry.show(name).revisions
            return next((r.rank for r in revisions if r.revision == revision), None)
        except RegistryError:  # removed meanwhile
            return None

    def state(self) -> dict:
        """GET /admin/state: residency of every adapter and the load figures the router needs."""
        live = self.live_figures()
        cache = live["cache"]
        return {
            "base_model": self.config.served_model_name,
            "base_model_digest": self.engine.base_model_digest,
            "max_loras": live["max_lora"],
            "draining": self.is_draining,
            "adapters": cache["adapters"],
            "load": {
                "waiting": live["num_waiting"], "running": live["num_running"],
                "active_tokens": live["active_tokens"], "recent_evictions": cache["recent_evictions"],
                "free_slots": cache["free_slots"], "num_slots": cache["num_slots"],
                "kv_cache_usage": live["kv_cache_usage"], "admitted_waiting": self.admission.num_waiting,
                "in_flight": self.admission.num_in_flight,
            },
            "cache": {k: v for k, v in cache.items() if k not in ("adapters",)},
        }


_TIER_STAGES = {"cpu": {"h2d", "activation"}, "disk": {"disk", "h2d", "activation"},
                "remote": {"download", "disk", "h2d", "activation"}}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def create_app(engine: LLMEngine, registry: Registry, config: ServerConfig,
               api_keys: dict[str, str] | None = None) -> FastAPI:
    """The OpenAI-compatible app (and the admin API on it unless `config.admin_on_main_app` is False)."""
    server = Server(engine, registry, config, api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="loraplex", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_handlers(app)
    app.add_middleware(RequestMiddleware, on_done=server.finish_request)
    app.include_router(openai_api.router)
    app.include_router(health)
    if config.admin_token and config.admin_on_main_app:
        app.include_router(admin.router(config.admin_token))
    return app


def create_admin_app(server: Server) -> FastAPI:
    """The admin API alone, for its own port, over the main app's server (`app.state.server`, whose app runs
    the engine)."""
    if not server.config.admin_token:
        raise ValueError("the admin API needs an admin token")
    app = FastAPI(title="loraplex admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_handlers(app)
    app.add_middleware(RequestMiddleware, on_done=server.finish_request)
    app.include_router(admin.router(server.config.admin_token))
    return app


health = APIRouter()


@health.get("/health")
async def alive():
    return {"status": "ok"}


@health.get("/ready")
async def ready(request: Request):
    server: Server = request.app.state.server
    if server.async_engine is None or server.is_draining:
        raise APIError(503, "not ready: " + ("shutting down" if server.is_draining else "starting"), "not_ready")
    return {"status": "ready", "model": server.config.served_model_name}


@health.get("/metrics")
async def metrics(request: Request):
    server: Server = request.app.state.server
    if server.config.metrics_token:
        check_token(request.headers.get("authorization"), server.config.metrics_token, "metrics")
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _rule_tier(adapter: AdapterRecord) -> str | None:
    """The tier a name's serving revisions are pinned in: its pin's, else its warm policy's (gpu or cpu)."""
    return adapter.pin_tier if adapter.pinned else (
        adapter.warm_policy if adapter.warm_policy in ("gpu", "cpu") else None)


def _serving_revisions(adapter: AdapterRecord) -> frozenset[str]:
    return frozenset(r.revision for r in adapter.revisions if r.traffic_weight)
