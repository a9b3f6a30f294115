"""`loraplex serve` with wall-clock probes on the request path's waits, for `vs_vllm_split.py`.

    python bench/split_probe.py OUT.jsonl serve ARGS...    (the arguments of `loraplex serve`)

Every call of a probed method appends one line to OUT.jsonl when it returns or raises:
`{"name": ..., "end": time.time(), "s": seconds}`. Probed, where the running tree has them:
- `acquire`: the server's `Admitted.acquire`, a request's whole wait before it is handed to the
  engine (vLLM: loraplex's residency; native: nothing, its scheduler admits);
- `slot_wait`: `VllmResidency._wait_for_slot`, the wait for a device slot loraplex lets the request
  have (the admission wait proper);
- `load`: `VllmResidency._load`, a wait for the adapter's staging and vLLM's `add_lora`;
- `stage`: `StagedCopies.stage` (loader thread), staging one adapter's bytes;
- `add_lora`: `VllmSlots.add`, the round trip of vLLM's `add_lora`.
A method the tree does not have is left out and named in a `{"missing": ...}` line. Nothing else
changes: the wrapped methods run as they are.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import sys
import threading
import time

PROBES = {  # name: (module, class, method)
    "acquire": ("loraplex.server.admission", "Admitted", "acquire"),
    "slot_wait": ("loraplex.engines.vllm.residency", "VllmResidency", "_wait_for_slot"),
    "load": ("loraplex.engines.vllm.residency", "VllmResidency", "_load"),
    "stage": ("loraplex.engines.vllm.staging", "StagedCopies", "stage"),
    "add_lora": ("loraplex.engines.vllm.slots", "VllmSlots", "add"),
}


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
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def timed_async(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                sink.write({"name": name, "end": time.time(), "s": time.perf_counter() - start})

        return timed_async

    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            sink.write({"name": name, "end": time.time(), "s": time.perf_counter() - start})

    return timed


def install(path: str) -> list[str]:
    """Wrap every probe the tree has; the names of those it lacks."""
    sink, missing = Sink(path), []
    for name, (module_name, class_name, method_name) in PROBES.items():
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
    if len(argv) < 2:
        print("usage: split_probe.py OUT.jsonl serve ARGS...", file=sys.stderr)
        return 2
    install(argv[0])
    from loraplex.cli import main as cli_main

    sys.argv = ["loraplex", *argv[1:]]
    cli_main()  # typer exits with the command's status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
