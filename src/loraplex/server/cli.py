"""The `serve` command (typer). The top-level CLI registers it as `app.command()(serve)`;
`python -m loraplex.server.cli --model DIR ...` runs it alone.

Each option's name is a ServeOptions field; `--config FILE` (YAML) gives the same options by the
same names, and the flags given on the command line override the file's values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loraplex.server.serve import (
    ServeOptions,
    StartupError,
    parse_lora_module,
    parse_score_weights,
    run,
)
from loraplex.units import parse_size

ENGINE, CACHE, TENANCY, SECURITY, OBSERVABILITY = (
    "Engine",
    "Cache",
    "Tenancy and limits",
    "Security",
    "Observability",
)
SIZES = (
    "kv_cache_memory_bytes",
    "cpu_cache_bytes",
    "disk_cache_bytes",
    "max_lora_bytes_per_step",
    "max_body_bytes",
)
"""Options given as sizes (`512MiB`, `4GiB` or bytes)."""


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "loraplex"


def load_config_file(
    ctx: typer.Context, param: typer.CallbackParam, path: Path | None
) -> Path | None:
    """`--config FILE`: its values become the defaults of the other options (so flags override
    them), each checked by its option's own type; a bad file is one line on stderr and exit 2."""
    if path is None:
        return None
    try:
        ctx.default_map = {**(ctx.default_map or {}), **read_config_file(ctx, path)}
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return path


def read_config_file(ctx: typer.Context, path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise StartupError(f"--config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise StartupError(f"--config {path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise StartupError(f"--config {path}: expected a mapping of option names to values")
    params = {
        p.name: p
        for p in ctx.command.params
        if p.param_type_name == "option" and p.name != "config"
    }
    out = {}
    for key, value in data.items():
        name = str(key).removeprefix("--").replace("-", "_")
        param = params.get(name)
        if param is None:
            raise StartupError(
                f"--config {path}: unknown key {key!r} (the keys are serve's option "
                "names, e.g. max-model-len)"
            )
        if name == "score_weights" and isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        if name == "lora_modules" and isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        if param.multiple and not isinstance(value, list):
            value = [value]
        value = [_text(v) for v in value] if param.multiple else _text(value)
        try:  # checked now, by the option's own type, to name the key; used as a default later
            param.get_runtime_param().coerce(value, param=param, ctx=ctx)
        except typer.BadParameter as exc:
            raise StartupError(f"--config {path}: key {key!r}: {exc.message}") from None
        out[name] = value
    return out


def _text(value):
    """YAML scalars as click's types read them from a command line (sizes and paths as text)."""
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else str(value)


Opt = typer.Option


def serve(
    model: Annotated[Path, Opt(help="Base model directory (Hugging Face layout)")],
    config: Annotated[
        Path | None,
        Opt(
            help="YAML file of these options by name (max-model-len: 4096); flags override it",
            is_eager=True,
            callback=load_config_file,
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, Opt(help="Name of the base model in requests (default: the directory's name)")
    ] = None,
    lora_modules: Annotated[
        list[str] | None,
        Opt(
            help="NAME=DIR adapters registered as shared at "
            "start; several after one flag, or repeat "
            "it"
        ),
    ] = None,
    # engine
    engine: Annotated[
        str, Opt(help="native (loraplex's engine) | vllm (vLLM's AsyncLLM)", rich_help_panel=ENGINE)
    ] = "native",
    engine_core: Annotated[
        str | None,
        Opt(
            help="native: where the step loop runs: process (its own, spoken to over Unix sockets; "
            "the default) | thread (of the API server's process)",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int | None, Opt(help="vLLM: GPUs the model is split over", rich_help_panel=ENGINE)
    ] = None,
    enable_prefix_caching: Annotated[
        bool | None,
        Opt(help="vLLM: share the KV blocks of common prefixes", rich_help_panel=ENGINE),
    ] = None,
    base_as_zero_adapter: Annotated[
        str,
        Opt(
            help="vLLM: carry base requests as an all-zero adapter: auto (on vLLM's CPU backend) "
            "| on | off",
            rich_help_panel=ENGINE,
        ),
    ] = "auto",
    vllm_arg: Annotated[
        list[str] | None,
        Opt(
            help="vLLM: another engine option as `vllm serve` spells it, e.g. "
            "--vllm-arg=--enforce-eager; repeat it",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    dtype: Annotated[
        str, Opt(help="auto | float32 | bfloat16 | float16", rich_help_panel=ENGINE)
    ] = "auto",
    device: Annotated[str, Opt(help="auto | cpu | cuda", rich_help_panel=ENGINE)] = "auto",
    max_model_len: Annotated[
        int | None,
        Opt(
            help="Prompt plus completion tokens per sequence (default: the model's, at most 4096)",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    max_num_seqs: Annotated[
        int, Opt(help="Sequences in the running batch", rich_help_panel=ENGINE)
    ] = 64,
    max_num_batched_tokens: Annotated[
        int, Opt(help="Tokens one step processes (>= max-model-len)", rich_help_panel=ENGINE)
    ] = 4096,
    block_size: Annotated[int, Opt(help="Tokens per KV cache block", rich_help_panel=ENGINE)] = 16,
    seed: Annotated[
        int, Opt(help="Sampling seed of requests without their own", rich_help_panel=ENGINE)
    ] = 0,
    kv_cache_memory_bytes: Annotated[
        str | None,
        Opt(
            help="KV cache size, e.g. 4GiB (default: sized from the device's memory)",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    gpu_memory_utilization: Annotated[
        float,
        Opt(
            help="CUDA: share of the device's memory for weights, activations and KV cache",
            rich_help_panel=ENGINE,
        ),
    ] = 0.9,
    max_lora_bytes_per_step: Annotated[
        str | None,
        Opt(
            help="Cap on the summed bytes of the adapters in "
            "one step, e.g. 64MiB (rank-aware "
            "admission)",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    # cache
    max_loras: Annotated[int, Opt(help="Adapter slots on the device", rich_help_panel=CACHE)] = 4,
    max_cpu_loras: Annotated[
        int | None, Opt(help="Adapters kept in host memory (count)", rich_help_panel=CACHE)
    ] = None,
    cpu_cache_bytes: Annotated[
        str | None,
        Opt(help="Host memory for adapters, e.g. 4GiB (default 2GiB)", rich_help_panel=CACHE),
    ] = None,
    disk_cache_bytes: Annotated[
        str | None,
        Opt(help="Local artifact cache budget, e.g. 20GiB (default 20GiB)", rich_help_panel=CACHE),
    ] = None,
    max_lora_rank: Annotated[
        int, Opt(help="Largest adapter rank accepted", rich_help_panel=CACHE)
    ] = 64,
    eviction_policy: Annotated[str, Opt(help="score | lru", rich_help_panel=CACHE)] = "score",
    score_weights: Annotated[
        str | None,
        Opt(
            help="score policy weights NAME=W,...: recency (1), "
            "frequency (2), priority (0.5), cost (1), size (0.1 "
            "per GiB), preferred (2)",
            rich_help_panel=CACHE,
        ),
    ] = None,
    min_residency_s: Annotated[
        float | None,
        Opt(
            help="score: seconds a new hot adapter is kept against one-offs (default 1)",
            rich_help_panel=CACHE,
        ),
    ] = None,
    max_gpu_preferred: Annotated[
        int | None,
        Opt(
            help="Adapters demand may promote to the gpu warm set (default: max-loras)",
            rich_help_panel=CACHE,
        ),
    ] = None,
    thrash_window_s: Annotated[
        float,
        Opt(
            help="A reload within this many seconds of its eviction is thrash",
            rich_help_panel=CACHE,
        ),
    ] = 60.0,
    load_threads: Annotated[
        int, Opt(help="Threads loading adapters in parallel", rich_help_panel=CACHE)
    ] = 2,
    grace_period_s: Annotated[
        float,
        Opt(
            help="A revision that left traffic stays in host memory this long (fast rollback)",
            rich_help_panel=CACHE,
        ),
    ] = 600.0,
    # tenancy and request limits
    max_requests_per_tenant: Annotated[
        int,
        Opt(
            help="Requests in flight per tenant, for tenants without their own limit",
            rich_help_panel=TENANCY,
        ),
    ] = 256,
    max_waiting: Annotated[
        int, Opt(help="Requests waiting for a first token; 429 beyond", rich_help_panel=TENANCY)
    ] = 512,
    tenant_gpu_share: Annotated[
        float,
        Opt(
            help="Share of the device slots a tenant without a budget of its own may hold "
            "(1.0: no limit)",
            rich_help_panel=TENANCY,
        ),
    ] = 1.0,
    tenant_cpu_share: Annotated[
        float,
        Opt(
            help="Share of the host memory a tenant without a budget of its own may hold "
            "(1.0: no limit)",
            rich_help_panel=TENANCY,
        ),
    ] = 1.0,
    max_prompt_tokens: Annotated[
        int | None, Opt(help="Longest prompt (default: max-model-len - 1)", rich_help_panel=TENANCY)
    ] = None,
    max_body_bytes: Annotated[
        str, Opt(help="Largest request body; 413 beyond", rich_help_panel=TENANCY)
    ] = "4MiB",
    unload_timeout_s: Annotated[
        float,
        Opt(help="How long an unload waits for the adapter's requests", rich_help_panel=TENANCY),
    ] = 60.0,
    shutdown_timeout_s: Annotated[
        float,
        Opt(help="On SIGTERM, how long requests in flight may finish", rich_help_panel=TENANCY),
    ] = 30.0,
    # security
    api_keys: Annotated[
        Path | None, Opt(help="File of `TENANT KEY` lines", rich_help_panel=SECURITY)
    ] = None,
    admin_token_file: Annotated[
        Path | None,
        Opt(
            help="Admin token on the file's first line (no file: admin API off)",
            rich_help_panel=SECURITY,
        ),
    ] = None,
    admin_port: Annotated[
        int | None, Opt(help="Serve the admin API on this port instead", rich_help_panel=SECURITY)
    ] = None,
    metrics_token_file: Annotated[
        Path | None,
        Opt(
            help="Token /metrics requires, on the file's first "
            "line (no file: /metrics is open, as vLLM's)",
            rich_help_panel=SECURITY,
        ),
    ] = None,
    allowed_roots: Annotated[
        list[str] | None,
        Opt(
            help="Directories the admin API may register adapters from; several after one flag",
            rich_help_panel=SECURITY,
        ),
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        Opt(
            help="ed25519 public key (PEM); repeat; with any, "
            "every adapter registered or loaded must be "
            "signed",
            rich_help_panel=SECURITY,
        ),
    ] = None,
    strict_base_model_name: Annotated[
        bool,
        Opt(
            help="Refuse an adapter whose config names another base model (default: a warning)",
            rich_help_panel=SECURITY,
        ),
    ] = False,
    release_min_pass_rate: Annotated[
        float,
        Opt(
            help="Share of a revision's eval-set cases that must pass to promote it",
            rich_help_panel=SECURITY,
        ),
    ] = 1.0,
    key_cache_ttl_s: Annotated[
        float,
        Opt(
            help="Seconds an API key lookup is trusted (revocations apply within it)",
            rich_help_panel=SECURITY,
        ),
    ] = 5.0,
    # observability
    audit_log: Annotated[
        str | None,
        Opt(
            help="JSONL audit file (default DATA_DIR/audit.jsonl); - for stdout, off for none",
            rich_help_panel=OBSERVABILITY,
        ),
    ] = None,
    top_k_adapter_metrics: Annotated[
        int,
        Opt(
            help="Per-adapter request counts in /metrics for the K busiest adapters",
            rich_help_panel=OBSERVABILITY,
        ),
    ] = 0,
    lora_load_state_metrics: Annotated[
        int,
        Opt(
            help="Export vllm:lora_adapter_loaded for the K best-placed adapters (0: off)",
            rich_help_panel=OBSERVABILITY,
        ),
    ] = 0,
    # where
    host: Annotated[str, Opt(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, Opt(help="Port (0: a free one, printed at start)")] = 8000,
    data_dir: Annotated[
        Path | None, Opt(help="Data directory (default: ~/.local/share/loraplex)")
    ] = None,
    registry: Annotated[
        str | None, Opt(help="Registry database URL (default: sqlite:///DATA_DIR/registry.db)")
    ] = None,
    registry_watch_s: Annotated[
        float, Opt(help="How often changes made elsewhere in the registry are picked up")
    ] = 2.0,
    extra: Annotated[list[str] | None, typer.Argument(hidden=True)] = None,
):
    """Serve the OpenAI-compatible API over one base model and its adapters."""
    given = dict(locals())
    try:
        run(serve_options(given))
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def serve_options(given: dict) -> ServeOptions:
    """ServeOptions from `serve`'s parameters (the same names), text parsed where a flag is text."""
    values = {k: v for k, v in given.items() if k not in ("config", "extra", "trusted_key")}
    vllm_args = _vllm_args(
        values.pop("tensor_parallel_size"),
        values.pop("enable_prefix_caching"),
        values.pop("vllm_arg"),
    )
    modules, roots = _variadic(
        list(values.pop("lora_modules") or ()),
        list(values.pop("allowed_roots") or ()),
        list(given["extra"] or ()),
    )
    for name in SIZES:
        values[name] = _size(values[name], "--" + name.replace("_", "-"))
    score = values.pop("score_weights")
    values["data_dir"] = values["data_dir"] or _default_data_dir()
    return ServeOptions(
        **values,
        lora_modules=tuple(parse_lora_module(m) for m in modules),
        allowed_roots=tuple(roots),
        trusted_keys=tuple(given["trusted_key"] or ()),
        score_weights=parse_score_weights(score) if score else (),
        vllm_args=vllm_args,
    )


def _vllm_args(
    tensor_parallel_size: int | None, prefix_caching: bool | None, more: list[str] | None
) -> tuple[str, ...]:
    """The options passed to vLLM as `vllm serve` takes them (`--vllm-arg=--name=value`: two)."""
    out = []
    if tensor_parallel_size is not None:
        out += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if prefix_caching is not None:
        out.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    for arg in more or ():
        out += arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]
    return tuple(out)


def _variadic(
    modules: list[str], roots: list[str], extra: list[str]
) -> tuple[list[str], list[str]]:
    """vLLM-style `--lora-modules a=DIR b=DIR` and `--allowed-roots D1 D2`: click takes the first
    value after the flag, the others arrive as positional values; NAME=DIR ones are adapters, the
    rest allowed roots."""
    for value in extra:
        if "=" in value and modules:
            modules.append(value)
        elif "=" not in value and roots:
            roots.append(value)
        else:
            raise StartupError(f"unexpected argument {value!r}")
    return modules, roots


def _size(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise StartupError(f"{flag}: {exc}") from None


if __name__ == "__main__":
    typer.run(serve)
