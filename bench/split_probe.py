"""`loraplex serve` with wall-clock probes on the request path's waits, for `vs_vllm_split.py`.

    python bench/split_probe.py OUT.jsonl serve ARGS...    (the arguments of `loraplex serve`)
    python bench/split_probe.py OUT.jsonl vllm ARGS...     (vLLM's OpenAI server's arguments)

Every call of a probed method appends one line to OUT.jsonl when it returns or raises:
`{"name": ..., "end": time.time(), "s": seconds}`. Probed, where the running tree has them:
- `acquire`: the server's `Admitted.acquire`, a request's whole wait before it is handed to the
  engine (vLLM: loraplex's residency; native: nothing, its scheduler admits);
- `slot_wait`: `RuntimeCacheBackend._wait_for_slot`, the wait for a device slot loraplex lets the
  request have (the admission wait proper);
- `load`: `RuntimeCacheBackend._load`, a wait for the adapter's staging and vLLM's `add_lora`;
- `stage`: `StagedCopies.stage` (loader thread), staging one adapter's bytes;
- `add_lora`: `RuntimeSlots.add`, the round trip of vLLM's `add_lora`;
- `step` (both servers on vLLM): vLLM's `OutputProcessor.process_outputs`, called in the API
  process once per engine step that produced tokens, with `rows`: the requests that got a token.
A method the tree does not have is left out and named in a `{"missing": ...}` line. Nothing else
changes: the wrapped methods run as they are.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import runpy
import sys
import threading
import time

PROBES = {  # name: (module, class, method)
    "acquire": ("loraplex.server.admission", "Admitted", "acquire"),
    "slot_wait": ("loraplex.residency.runtime_cache", "RuntimeCacheBackend", "_wait_for_slot"),
    "load": ("loraplex.residency.runtime_cache", "RuntimeCacheBackend", "_load"),
    "stage": ("loraplex.engines.vllm.staging", "StagedCopies", "stage"),
    "add_lora": ("loraplex.residency.runtime", "RuntimeSlots", "add"),
    "step": ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
}
ROWS = {
    "step": lambda args: len(args[1])
}  # probe: what else its record holds, from the call's args


class Sink:
    """Lines appended to one file, from the event loop and loader threads alike."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self.lock:
            self.file.write(line)


def wrap(sink: Sink, name: str, method):
    rows = ROWS.get(name)

    def record(start: float, args) -> None:
        line = {"name": name, "end": time.time(), "s": time.perf_counter() - start}
        if rows is not None:
            line["rows"] = rows(args)
        sink.write(line)

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def timed_async(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                record(start, args)

        return timed_async

    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record(start, args)

    return timed


def install(path: str, names) -> list[str]:
    """Wrap the probes of `names` the tree has; the names of those it lacks."""
    sink, missing = Sink(path), []
    for name in names:
        module_name, class_name, method_name = PROBES[name]
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            method = getattr(cls, method_name)
        except (ImportError, AttributeError):
            missing.append(name)
            continue
        setattr(cls, method_name, wrap(sink, name, method))
    if missing:
        sink.write({"missing": missing})
    return missing


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("serve", "vllm"):
        print("usage: split_probe.py OUT.jsonl {serve|vllm} ARGS...", file=sys.stderr)
        return 2
    if argv[1] == "vllm":
        install(argv[0], ["step"])
        sys.argv = ["vllm.entrypoints.openai.api_server", *argv[2:]]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
        return 0
    engine = argv[argv.index("--engine") + 1] if "--engine" in argv[:-1] else "native"
    install(argv[0], [n for n in PROBES if n != "step" or engine == "vllm"])
    from loraplex.cli import main as cli_main

    sys.argv = ["loraplex", *argv[1:]]
    cli_main()  # typer exits with the command's status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
