"""The `serve` command (typer). The top-level CLI registers it as `app.command()(serve)`;
`python -m loraplex.server.cli --model DIR ...` runs it alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loraplex.config import parse_size
from loraplex.server.serve import ServeOptions, StartupError, parse_lora_module, run


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "loraplex"


def serve(
    model: Annotated[Path, typer.Option(help="Base model directory (Hugging Face layout)")],
    served_model_name: Annotated[str | None, typer.Option(help="Name of the base model in requests "
                                                                "(default: the directory's name)")] = None,
    lora_modules: Annotated[list[str] | None, typer.Option(help="NAME=DIR adapters registered as shared at "
                                                                 "start; several after one flag, or repeat it")] = None,
    max_loras: Annotated[int, typer.Option(help="Adapter slots on the device")] = 4,
    max_cpu_loras: Annotated[int | None, typer.Option(help="Adapters kept in host memory (count)")] = None,
    cpu_cache_bytes: Annotated[str | None, typer.Option(help="Host memory for adapters, e.g. 4GiB")] = None,
    disk_cache_bytes: Annotated[str | None, typer.Option(help="Local artifact cache budget, e.g. 20GiB")] = None,
    max_lora_rank: Annotated[int, typer.Option(help="Largest adapter rank accepted")] = 64,
    eviction_policy: Annotated[str, typer.Option(help="score | lru")] = "score",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed at start)")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Data directory (default: ~/.local/share/loraplex)")] = None,
    registry: Annotated[str | None, typer.Option(help="Registry database URL "
                                                      "(default: sqlite:///DATA_DIR/registry.db)")] = None,
    api_keys: Annotated[Path | None, typer.Option(help="File of `TENANT KEY` lines")] = None,
    admin_token_file: Annotated[Path | None, typer.Option(help="Admin token on the file's first line "
                                                               "(no file: admin API off)")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Serve the admin API on this port instead")] = None,
    metrics_token_file: Annotated[Path | None, typer.Option(help="Token /metrics requires, on the file's first "
                                                                 "line (no file: /metrics is open, as vLLM's)")] = None,
    lora_load_state_metrics: Annotated[int, typer.Option(
        help="Export vllm:lora_adapter_loaded for the K best-placed adapters (0: off)")] = 0,
    allowed_roots: Annotated[list[str] | None, typer.Option(help="Directories the admin API may register "
                                                                  "adapters from; several after one flag")] = None,
    extra: Annotated[list[str] | None, typer.Argument(hidden=True)] = None,
):
    """Serve the OpenAI-compatible API over one base model and its adapters."""
    try:
        modules, roots = _variadic(list(lora_modules or ()), list(allowed_roots or ()), list(extra or ()))
        options = ServeOptions(
            model=model, data_dir=data_dir or _default_data_dir(), served_model_name=served_model_name,
            lora_modules=tuple(parse_lora_module(m) for m in modules), max_loras=max_loras,
            max_cpu_loras=max_cpu_loras, cpu_cache_bytes=_size(cpu_cache_bytes, "--cpu-cache-bytes"),
            disk_cache_bytes=_size(disk_cache_bytes, "--disk-cache-bytes"), max_lora_rank=max_lora_rank,
            eviction_policy=eviction_policy, dtype=dtype, device=device, host=host, port=port, registry=registry,
            api_keys=api_keys, admin_token_file=admin_token_file, admin_port=admin_port,
            metrics_token_file=metrics_token_file, lora_load_state_metrics=lora_load_state_metrics,
            allowed_roots=tuple(roots),
        )
        run(options)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _variadic(modules: list[str], roots: list[str], extra: list[str]) -> tuple[list[str], list[str]]:
    """vLLM-style `--lora-modules a=DIR b=DIR` and `--allowed-roots D1 D2`: click takes the first value after
    the flag, the others arrive as positional values; NAME=DIR ones are adapters, the rest allowed roots."""
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
