"""What a simulation runs: the fleet's capacities, engine, pools, router, budgets, costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.runtime import HOST_BYTES_UNBOUNDED
from loraplex.settings.router import DEFAULTS as ROUTER
from loraplex.sim.calibration import LoadCosts, ServiceModel
from loraplex.sim.pools import SimPool as PoolOfWorkers

# Llama-2-7B (hidden 4096, intermediate 11008, 32 layers), LoRA on all seven linear modules,
# bfloat16: 2 bytes × 32 layers × (4 × (4096 + 4096) + 3 × (4096 + 11008)) per unit of rank.
LLAMA7B_BYTES_PER_RANK = 2 * 32 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
TIERS = ("gpu", "cpu", "disk", "remote")


ENGINES = ("native", "vllm")
ROUTINGS = ("router", "controller", "epp")


@dataclass(frozen=True)
class SimConfig:
    engine: str = "native"
    """Whose residency backend and scheduling each worker runs: the native engine's, or the vLLM
    engine's (over a modelled vLLM: `loraplex.sim.vllm_worker`)."""
    gpu_slots: int = 8
    cpu_bytes: int = 4 * 2**30
    max_cpu_loras: int | None = None
    """Adapters in host memory at most (vLLM: its host cache, 4 per slot by default, as `serve`)."""
    disk_bytes: int | None = None
    """None: an artifact once fetched stays on the worker's disk."""
    local_adapters: bool = False
    """True: every adapter is a local directory (as with --lora-modules), so there is no remote
    tier."""
    workers: int = 1
    """With `pools`, their workers' sum."""
    pools: tuple[PoolOfWorkers, ...] = ()
    """The fleet as pools (`sim.pools`), routed as the router routes them; none: one shared pool."""
    router: str = "affinity"
    routing: str = "router"
    """Who picks a request's worker: `router` (the router's picker, `router` above), `controller`
    (the router honouring the placement controller's placements: `sim.placement`) or `epp` (an
    emulation of the llm-d EPP's default scorer profile: `sim.epp`)."""
    router_poll_s: float = 0.25
    """How old the router's view of each worker may be (it polls /admin/state)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    tenant_budgets: dict[str, Budget] | None = None
    """Residency budgets per tenant (`loraplex.residency.budgets`), as the registry keeps them."""
    tenant_gpu_share: float = 1.0
    tenant_cpu_share: float = 1.0
    """The default budget of a tenant without its own, as `serve
    --tenant-gpu-share/--tenant-cpu-share`."""
    bytes_per_rank: int = LLAMA7B_BYTES_PER_RANK
    """An adapter's host-copy bytes are its rank times this, unless `adapter_bytes` names it."""
    adapter_bytes: dict[str, int] | None = None
    """Bytes per `name@revision`, overriding the rank rule (e.g. measured packed sizes)."""
    service: ServiceModel = field(default_factory=ServiceModel)
    costs: LoadCosts = field(default_factory=LoadCosts)
    skip_blocked: bool = True
    """Do not call the cache's acquire when it can only fail, the adapter loading or every slot held
    (same results, faster)."""
    skip_quiet_steps: bool = True
    """End at once the steps that can change nothing: no arrival at the worker, none of its loads or
    finishes before they end and no waiting request that could be admitted (same results,
    faster)."""
    idle_poll_s: float = 0.01
    """A worker whose waiting requests found no slot and has nothing running or loading tries again
    after this."""
    pins: tuple[tuple[str, str], ...] = ()
    """(model, tier): adapters of the trace (`name@revision`) pinned to `gpu` or `cpu` on every
    worker before the first arrival, as the operator's `POST /admin/adapters/{name}/pin`."""
    fair_share: bool = False
    """Requests no worker has room for wait at the router in per-tenant queues, granted in
    weighted fair order (`sim.fair_share`); False: they go to a saturated worker's queue."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """(tenant, weight) in the fair share (a tenant not named weighs 1)."""
    queue_per_tenant: int = ROUTER.queue_per_tenant
    """Requests a tenant may have waiting at the router (more are refused, the router's 429)."""
    holdback_window_s: float = ROUTER.holdback_window_s
    """With fair share: the router's held-back places (`router/holdback.py`), a tenant active
    while a request of its arrived within this many seconds (0: no place held)."""
    kv_prefix_blocks: int = 0
    """Each worker's KV cache for prompt prefixes, in 16-token blocks, and the router's prefix
    index per worker at the same size (`sim.prefix_cache`); 0: prefixes not modelled."""
    seed: int = 0
    registry_changes_per_s: float = 0.0
    """Registry changes per second (`loraplex.sim.registry_load`): notified to every worker, each
    worker's next request for the changed adapter resolves it again."""

    def __post_init__(self):
        if self.pools:
            object.__setattr__(self, "workers", sum(p.workers for p in self.pools))
        if self.gpu_slots < 1 or self.workers < 1 or self.cpu_bytes < 0:
            raise ValueError("gpu_slots and workers must be at least 1, cpu_bytes non-negative")
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r}: use one of {', '.join(ROUTINGS)}")
        if self.routing != "router" and (self.engine != "native" or self.pools):
            raise ValueError(f"routing {self.routing}: one pool of native-engine workers only")
        if (self.fair_share or self.kv_prefix_blocks) and self.engine != "native":
            raise ValueError("fair share and prefix caches: native-engine workers only")
        if self.fair_share and self.routing != "router":
            raise ValueError(f"fair share: routing router only, not {self.routing}")
        if self.kv_prefix_blocks < 0 or self.queue_per_tenant < 1 or self.holdback_window_s < 0:
            raise ValueError(
                "kv_prefix_blocks and holdback_window_s must be >= 0, queue_per_tenant >= 1"
            )
        self.budgets()  # refuses a share outside [0, 1]

    def budgets(self) -> TenantBudgets:
        """The budgets on this capacity: one beyond it is capped at it (a sizing sweep runs smaller
        caches)."""
        capped = {
            t: Budget(
                None if b.gpu_slots is None else min(b.gpu_slots, self.gpu_slots),
                None if b.cpu_bytes is None else min(b.cpu_bytes, self.cpu_bytes),
            )
            for t, b in (self.tenant_budgets or {}).items()
        }
        # vLLM's host cache counts adapters, not bytes: no byte capacity bounds a host budget there
        cpu_bytes = self.cpu_bytes if self.engine == "native" else HOST_BYTES_UNBOUNDED
        return TenantBudgets(
            self.gpu_slots, cpu_bytes, capped, self.tenant_gpu_share, self.tenant_cpu_share
        )


def config_dict(config: SimConfig) -> dict:
    out = asdict(config)
    out["service"] = asdict(config.service)
    out["costs"] = config.costs.to_dict()
    return out
