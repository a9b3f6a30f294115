"""`loraplex serve`'s settings: each one's flag (`--max-loras`), `--config` key (`max-loras`),
environment variable (`LORAPLEX_MAX_LORAS`), help, docs row and check, declared once here. The
engines' configurations take the settings that are their fields by name
(`EngineConfig.from_settings`, `VllmConfig.from_settings`) and their defaults from `DEFAULTS`; the
API server reads an instance itself (`ServerConfig.settings`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.settings.fields import (
    Conflict,
    Matches,
    at_least,
    check_fields,
    open_share,
    port_number,
    positive,
    setting,
    share,
    weights,
)
from loraplex.settings.serve_values import (
    HOST_CACHE_BYTES,
    MIN_RESIDENCY_S,
    SCORE_WEIGHTS,
    VLLM_HOST_CACHE_PER_SLOT,
    check_vllm,
    parse_lora_modules,
)
from loraplex.units import format_size

WHERE, ENGINE, CACHE, TENANCY, SECURITY, OBSERVABILITY = (
    "Where",
    "Engine",
    "Cache",
    "Tenancy and limits",
    "Security",
    "Observability",
)
ENV_PREFIX = "LORAPLEX_"


@dataclass(frozen=True)
class ServeSettings:
    # where
    model: Path = setting(
        help="Base model directory (Hugging Face layout)",
        panel=WHERE,
        metavar="DIR",
        doc="Hugging Face directory of a Llama-family model",
    )
    served_model_name: str | None = setting(
        None,
        "Name of the base model in requests (default: the directory's name)",
        panel=WHERE,
        metavar="NAME",
        default_text="the directory's name",
        doc="what `model` must say to get the base model",
    )
    lora_modules: tuple[tuple[str, Path], ...] = setting(
        (),
        "NAME=DIR adapters registered as shared at start; several after one flag, or repeat it",
        panel=WHERE,
        metavar="NAME=DIR",
        variadic="pairs",
        parse=parse_lora_modules,
        show=lambda modules: {name: str(path) for name, path in modules},
        schema={
            "type": ["object", "array", "string"],
            "items": {"type": "string", "pattern": "^[^=]+=.+$"},
            "additionalProperties": {"type": "string"},
        },
        doc="registered as **shared** stable revisions at start (several after one flag, or "
        "repeat it); a name owned by a tenant is refused; with trusted keys each needs "
        "`DIR/adapter.sig`",
    )
    host: str = setting("127.0.0.1", "Address to listen on", panel=WHERE)
    port: int = setting(
        8000,
        "Port (0: a free one, printed at start)",
        panel=WHERE,
        check=port_number,
    )
    data_dir: Path = setting(
        Path.home() / ".local" / "share" / "loraplex",
        "Data directory",
        panel=WHERE,
        metavar="DIR",
        default_text="~/.local/share/loraplex",
        doc="registry, artifacts, disk cache, `audit.jsonl`",
    )
    registry: str | None = setting(
        None,
        "Registry database URL",
        panel=WHERE,
        metavar="URL",
        default_text="sqlite:///DATA_DIR/registry.db",
        doc="the same database `loraplex registry` uses; PostgreSQL for many workers",
    )
    store: Path | None = setting(
        None,
        "Artifact store directory; with a server database, a volume every worker mounts here",
        panel=WHERE,
        metavar="DIR",
        default_text="artifacts/ beside a SQLite registry, else DATA_DIR/artifacts",
        doc="where revisions registered through this worker are stored, as `loraplex registry "
        "--store`: with a PostgreSQL registry, a volume every worker mounts at this path",
    )
    storage_base: str | None = setting(
        None,
        "OCI repository or S3 prefix revisions registered here are uploaded to",
        panel=WHERE,
        metavar="URL",
        doc="the shared store, as `loraplex registry --storage-base`: uploads and registrations "
        "through this worker are uploaded to this OCI repository (`oci://HOST/REPOSITORY`, "
        "`oci+http://` for plain http) or S3 prefix (`s3://BUCKET/PREFIX`) and recorded there, so "
        "that every worker reads them (docs/scale-out.md)",
    )
    registry_watch_s: float = setting(
        2.0,
        "How often the grace pins of revisions that left traffic are checked for their end",
        panel=WHERE,
        doc="how often the grace pins of revisions that left traffic are checked for the end of "
        "their period; changes made elsewhere arrive by the registry's change feed "
        "(docs/registry.md), not by polling",
    )
    # engine
    engine: str = setting(
        "native",
        "native (loraplex's engine) | vllm (vLLM's AsyncLLM)",
        panel=ENGINE,
        choices=("native", "vllm"),
        doc='which engine runs the model (below, "Engines")',
    )
    engine_core: str | None = setting(
        None,
        "native: where the step loop runs: process (its own, spoken to over Unix sockets) | "
        "thread (of the API server's process)",
        panel=ENGINE,
        choices=("process", "thread"),
        default_text="process",
        default_from=lambda s: "process" if s.engine == "native" else None,
        doc='native engine: where its step loop runs (below, "The native engine\'s process")',
    )
    tensor_parallel_size: int | None = setting(
        None, "vLLM: GPUs the model is split over", panel=ENGINE
    )
    enable_prefix_caching: bool | None = setting(
        None,
        "Share the KV blocks of common prompt prefixes (per adapter revision)",
        panel=ENGINE,
        default_text="on (vLLM: vLLM's)",
    )
    base_as_zero_adapter: str = setting(
        "auto",
        "vLLM: carry base requests as an all-zero adapter (auto: only on vLLM's CPU backend when "
        "loraplex's vLLM plugin does not fix its mixed batches)",
        panel=ENGINE,
        choices=("auto", "on", "off"),
        doc="vLLM: carry base requests as an all-zero adapter. `auto` is off wherever loraplex's "
        "vLLM plugin fixes vLLM-CPU's mixed base/LoRA batches (`docs/vllm-notes.md`), on for "
        "vLLM's CPU backend without it, off on GPUs. Where it is on, the zero adapter has a slot "
        "and a host cache place of vLLM's beyond `--max-loras` and `--max-cpu-loras`",
    )
    vllm_arg: tuple[str, ...] = setting(
        (),
        "vLLM: another engine option as `vllm serve` spells it, e.g. --vllm-arg=--enforce-eager; "
        "repeat it",
        panel=ENGINE,
        metavar="ARG",
    )
    dtype: str = setting(
        "auto",
        "Weights' and activations' type (auto: the model's own)",
        panel=ENGINE,
        choices=("auto", "float32", "bfloat16", "float16"),
        doc="float32 doubles weights and KV bytes per token",
    )
    device: str = setting(
        "auto",
        "auto (cuda when available) | cpu | cuda | cuda:N",
        panel=ENGINE,
        metavar="auto|cpu|cuda",
        check=Matches("use auto, cpu, cuda or cuda:N", "^(auto|cpu|cuda(:[0-9]+)?)$"),
    )
    max_model_len: int | None = setting(
        None,
        "Prompt plus completion tokens per sequence",
        panel=ENGINE,
        check=at_least(1),
        default_text="the model's, at most 4096",
        doc="longest prompt + completion; every sequence's KV must fit, so a longer one needs a "
        "larger KV cache",
    )
    max_num_seqs: int = setting(
        64,
        "Sequences in the running batch",
        panel=ENGINE,
        check=at_least(1),
        doc="sequences in the running batch: throughput against per-token latency and KV room",
    )
    max_num_batched_tokens: int = setting(
        4096,
        "Tokens one step processes; a longer prompt is prefilled in chunks over several steps",
        panel=ENGINE,
        check=at_least(1),
        doc="tokens in one step (prefill + one per decoding sequence); a prompt longer than the "
        "room left is prefilled in chunks over the next steps; larger: fewer steps per burst, "
        "longer steps for the decoders beside a prefill",
    )
    block_size: int = setting(
        16,
        "Tokens per KV cache block",
        panel=ENGINE,
        check=at_least(1),
        doc="tokens per KV block: larger blocks waste more of each sequence's last block",
    )
    seed: int = setting(
        0,
        "Sampling seed of requests without their own",
        panel=ENGINE,
        doc="sampling of requests that give no `seed` (a request's own `seed` wins)",
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV cache size, e.g. 4GiB",
        panel=ENGINE,
        unit="size",
        check=at_least(1),
        default_text="sized from the device",
        doc="the KV cache's memory: more sequences at once against memory for adapters and "
        'other processes (below, "Sizing the KV cache")',
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA: share of the device's memory for weights, activations and KV cache",
        panel=ENGINE,
        check=open_share,
        doc="CUDA, without `--kv-cache-memory-bytes`: the share of the device this worker fills "
        "(weights, adapter slots, activations, KV cache)",
    )
    max_lora_bytes_per_step: int | None = setting(
        None,
        "Cap on the summed bytes of the adapters in one step, e.g. 64MiB (rank-aware admission)",
        panel=ENGINE,
        unit="size",
        check=at_least(1),
        default_text="none",
        doc="rank-aware admission: the distinct adapters of one step sum to at most this, so "
        "high-rank adapters do not share a step's slot compute with many others; lower: fairer "
        "step times, fewer adapters per step",
    )
    # cache
    max_loras: int = setting(
        4,
        "Adapter slots on the device",
        panel=CACHE,
        check=at_least(1),
        doc="device slots: distinct adapters in one batch; each slot holds every target module "
        "at `--max-lora-rank`",
    )
    max_cpu_loras: int | None = setting(
        None,
        "Adapters kept in host memory (a count; or --cpu-cache-bytes)",
        panel=CACHE,
        check=at_least(1),
        default_text=f"vllm: {VLLM_HOST_CACHE_PER_SLOT} × --max-loras",
        default_from=lambda s: (
            VLLM_HOST_CACHE_PER_SLOT * s.max_loras if s.engine == "vllm" else None
        ),
        doc="the host-memory adapter cache as a count of adapters (instead of "
        "`--cpu-cache-bytes`); the vLLM engine's only measure of it, at least `--max-loras`",
    )
    cpu_cache_bytes: int | None = setting(
        None,
        "Host memory for adapters, e.g. 4GiB",
        panel=CACHE,
        unit="size",
        default_text=f"native: {format_size(HOST_CACHE_BYTES)}",
        default_from=lambda s: (
            HOST_CACHE_BYTES if s.engine == "native" and s.max_cpu_loras is None else None
        ),
        doc="host-memory adapter cache in bytes (or `--max-cpu-loras`, not both): more avoids "
        "disk reads and downloads, costs host memory",
    )
    disk_cache_bytes: int = setting(
        20 * 2**30,
        "Local artifact cache budget",
        panel=CACHE,
        unit="size",
        doc="local artifact cache (`DATA_DIR/cache`) of adapters fetched from remote stores",
    )
    max_lora_rank: int = setting(
        64,
        "Largest adapter rank accepted",
        panel=CACHE,
        check=at_least(1),
        doc="slots are padded to this rank (their memory grows with it); higher ranks are "
        "refused at registration",
    )
    eviction_policy: str = setting(
        "score",
        "Which adapters leave a full tier",
        panel=CACHE,
        choices=("score", "lru"),
        doc="see [cache.md](cache.md)",
    )
    score_weights: tuple[tuple[str, float], ...] = setting(
        (),
        "score policy weights NAME=W,...",
        panel=CACHE,
        metavar="NAME=W,...",
        parse=weights(SCORE_WEIGHTS),
        show=dict,
        schema={
            "type": ["object", "string"],
            "propertyNames": {"enum": list(SCORE_WEIGHTS)},
            "additionalProperties": {"type": "number"},
        },
        default_text="recency=1, frequency=2, priority=0.5, cost=1, size=0.1, preferred=2",
        doc="the terms of score's keep_score: recency (decays over 60 s), log of the 5-minute "
        "demand, the tenant's priority, the seconds a reload would take, bytes in GiB "
        "(subtracted), promotion to the warm set. Raise `priority` to let tenant priority "
        "outweigh demand",
    )
    min_residency_s: float | None = setting(
        None,
        "score: seconds a new hot adapter is kept against one-offs",
        panel=CACHE,
        check=at_least(0),
        default_text=f"{MIN_RESIDENCY_S:g}",
        default_from=lambda s: MIN_RESIDENCY_S if s.eviction_policy == "score" else None,
        doc="score: a newly loaded hot adapter is kept this long against one-offs with less "
        "demand; longer protects hot adapters, delays one-offs' slots",
    )
    max_gpu_preferred: int | None = setting(
        None,
        "Adapters demand may promote to the gpu warm set",
        panel=CACHE,
        check=at_least(0),
        default_text="--max-loras",
        doc="adapters that demand may promote to the gpu warm set (kept in or restored to slots)",
    )
    thrash_window_s: float = setting(
        60.0,
        "A reload within this many seconds of its eviction is thrash",
        panel=CACHE,
        check=positive,
        doc="a reload within this long of an eviction counts as thrash "
        "(`loraplex_adapter_thrash_ratio`, `recent_evictions` in `/admin/state`, which the "
        "router weighs)",
    )
    load_threads: int = setting(
        2,
        "Threads loading adapters in parallel",
        panel=CACHE,
        check=at_least(1),
        doc="loads (download, digest check, disk read) running at once; more overlap cold "
        "loads, take more cores and I/O from serving",
    )
    grace_period_s: float = setting(
        600.0,
        "A revision that left traffic stays in host memory this long (fast rollback)",
        panel=CACHE,
        doc="a revision that leaves traffic (promotion, rollback) stays pinned in host memory "
        "this long, so a rollback finds it warm",
    )
    # tenancy and request limits
    max_requests_per_tenant: int = setting(
        256,
        "Requests in flight per tenant, for tenants without their own limit",
        panel=TENANCY,
        check=at_least(1),
        doc="requests in flight per tenant (429 beyond), for tenants without a "
        "`max_concurrent_requests` of their own",
    )
    max_waiting: int = setting(
        512,
        "Requests waiting for a first token; 429 beyond",
        panel=TENANCY,
        check=at_least(0),
        doc="requests admitted but without a first token yet, all tenants (429 with "
        "`Retry-After` beyond): a short queue refuses early, a long one adds waiting time",
    )
    tenant_gpu_share: float = setting(
        1.0,
        "Share of the device slots a tenant without a budget of its own may hold (1.0: no limit)",
        panel=TENANCY,
        check=share,
        doc="residency budget of a tenant without its own: this share of the slots (rounded "
        'down); 1.0 is no limit (below, "Residency budgets")',
    )
    tenant_cpu_share: float = setting(
        1.0,
        "Share of the host memory a tenant without a budget of its own may hold (1.0: no limit)",
        panel=TENANCY,
        check=share,
        doc="the same, of the host-memory cache; not with `--engine vllm` (vLLM's host cache is "
        "counted in adapters)",
    )
    max_prompt_tokens: int | None = setting(
        None,
        "Longest prompt",
        panel=TENANCY,
        check=at_least(1),
        default_text="--max-model-len - 1",
        doc="longer prompts: 400 naming the limit",
    )
    max_body_bytes: int = setting(
        4 * 2**20,
        "Largest request body; 413 beyond",
        panel=TENANCY,
        unit="size",
        check=at_least(1),
        doc="larger bodies: 413",
    )
    max_upload_bytes: int = setting(
        4 * 2**30,
        "Largest adapter upload (the admin API's upload); 413 beyond",
        panel=TENANCY,
        unit="size",
        check=at_least(1),
        doc="a larger upload to `POST /admin/adapters/NAME/upload`: 413, nothing kept",
    )
    unload_timeout_s: float = setting(
        60.0,
        "How long an unload waits for the adapter's requests",
        panel=TENANCY,
        doc="an unload waits this long for the adapter's requests in flight (409 beyond)",
    )
    shutdown_timeout_s: float = setting(
        30.0,
        "On SIGTERM, how long requests in flight may finish",
        panel=TENANCY,
        doc="SIGTERM: time for requests in flight to finish before they are aborted",
    )
    # security
    api_keys: Path | None = setting(
        None,
        "File of `TENANT KEY` lines",
        panel=SECURITY,
        metavar="FILE",
        doc="`TENANT KEY` per line, `#` comments; keys of 16+ characters",
    )
    admin_token_file: Path | None = setting(
        None,
        "Admin token on the file's first line (no file: admin API off)",
        panel=SECURITY,
        metavar="FILE",
        doc="admin token on the first line (16+ characters); without it the admin API is off",
    )
    admin_port: int | None = setting(
        None,
        "Serve the admin API on this port instead",
        panel=SECURITY,
        metavar="PORT",
        check=port_number,
        doc="serve the admin API (and vLLM's load/unload) on this port only",
    )
    metrics_token_file: Path | None = setting(
        None,
        "Token /metrics requires, on the file's first line (no file: /metrics is open, as vLLM's)",
        panel=SECURITY,
        metavar="FILE",
        doc="`/metrics` answers only `Authorization: Bearer TOKEN` (token on the first line, 16+ "
        "characters). Without it `/metrics` is open, as vLLM's: it names the running adapters "
        "(`vllm:lora_requests_info`, which the Gateway API Inference Extension reads) and every "
        "tenant, so keep the port off the tenants' network or set a token (Prometheus: "
        "`authorization.credentials_file`)",
    )
    allowed_roots: tuple[str, ...] = setting(
        (),
        "Directories the admin API may register adapters from; several after one flag",
        panel=SECURITY,
        metavar="DIR",
        variadic="values",
        doc="directories (or URL prefixes) the admin API and `/v1/load_lora_adapter` may "
        "register adapters from",
    )
    trusted_key: tuple[Path, ...] = setting(
        (),
        "ed25519 public key (PEM); repeat; with any, every adapter registered or loaded must be "
        "signed",
        panel=SECURITY,
        metavar="FILE",
        doc="ed25519 public key (PEM), repeatable; with any, every adapter is signed by one of "
        'them (below, "Signatures")',
    )
    strict_base_model_name: bool = setting(
        False,
        "Refuse an adapter whose config names another base model (default: a warning)",
        panel=SECURITY,
        doc="refuse an adapter whose `base_model_name_or_path` names another model than the "
        "served directory; without it that is a warning (the shapes are checked either way)",
    )
    release_min_pass_rate: float = setting(
        1.0,
        "Share of a revision's eval-set cases that must pass to promote it",
        panel=SECURITY,
        check=share,
        doc="share of a revision's eval-set cases that must pass for a promotion out of staging",
    )
    key_cache_ttl_s: float = setting(
        5.0,
        "Seconds an API key lookup is trusted (revocations apply within it)",
        panel=SECURITY,
        doc="registry key lookups are trusted this long: a revoked key stops working within it; "
        "shorter asks the database more",
    )
    # observability
    audit_log: str | None = setting(
        None,
        "JSONL audit file; - for stdout, off for none",
        panel=OBSERVABILITY,
        metavar="FILE|-|off",
        default_text="DATA_DIR/audit.jsonl",
        doc="one JSON line per request (below); `-` writes to stdout, `off` writes none",
    )
    top_k_adapter_metrics: int = setting(
        0,
        "Per-adapter request counts in /metrics for the K busiest adapters",
        panel=OBSERVABILITY,
        doc="per-adapter request counts in `/metrics` for the K busiest adapters: labels per "
        "adapter cost series in Prometheus",
    )
    lora_load_state_metrics: int = setting(
        0,
        "Export vllm:lora_adapter_loaded for the K best-placed adapters (0: off)",
        panel=OBSERVABILITY,
        check=at_least(0),
        doc="add the residency series of the llm-d load-state proposal for the K best-placed "
        "adapters (`vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`, "
        "`vllm:num_gpu_loaded_lora_adapters`, `vllm:max_gpu_lora_adapters`; `docs/metrics.md`)",
    )

    def __post_init__(self):
        check_fields(self, ServeSettings)
        object.__setattr__(self, "model", Path(self.model))
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.store is not None:
            object.__setattr__(self, "store", Path(self.store))
        if self.engine_core == "process" and self.engine != "native":
            raise Conflict(
                "--engine-core process: for --engine native; vLLM runs its own",
                "engine_core",
                "engine",
            )
        if self.max_cpu_loras is not None and self.cpu_cache_bytes is not None:
            raise Conflict(
                "give --max-cpu-loras or --cpu-cache-bytes, not both",
                "max_cpu_loras",
                "cpu_cache_bytes",
            )
        if self.admin_port is not None and self.admin_token_file is None:
            raise Conflict("--admin-port needs --admin-token-file", "admin_port")
        tuned = [
            n for n in ("score_weights", "min_residency_s") if getattr(self, n) not in (None, ())
        ]
        if self.eviction_policy == "lru" and tuned:
            raise Conflict(
                "--score-weights and --min-residency-s apply to --eviction-policy score, not lru",
                "eviction_policy",
                *tuned,
            )
        if self.engine == "vllm":
            check_vllm(self)

    @property
    def registry_url(self) -> str:
        return self.registry or f"sqlite:///{self.data_dir / 'registry.db'}"

    @property
    def audit_log_target(self) -> str | Path | None:
        """`--audit-log`: a file (default DATA_DIR/audit.jsonl), `-` for stdout, `off` for none."""
        if self.audit_log is None:
            return self.data_dir / "audit.jsonl"
        return None if self.audit_log == "off" else self.audit_log


DEFAULTS = ServeSettings(model=Path("."))
"""Each setting's default, read by the configurations built from the settings."""
