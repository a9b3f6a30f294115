"""Where a server's CPU time goes, from py-spy's collapsed stacks (`py-spy record --subprocesses
--full-filenames --format raw`), for `vs_vllm_split.py`.

Each sample is one stack of one process: its process chain (`process PID:"CMDLINE"` frames, the
recorded process first), then its frames, root to leaf. The sampled process is the API process (the
one py-spy was pointed at) or one of its children: vLLM's engine core, the native engine's process.
A sample's part is decided by its innermost frame of a known owner (walking leaf to root), so work a
library does on loraplex's behalf counts as that library's: vLLM's request handling called from
loraplex's layer is vLLM's front end, a hash under the staging code is staging.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

API_PARTS = (  # (part, path fragments), tried in order on each frame, leaf to root
    ("staging", ("loraplex/engines/vllm/staging.py", "loraplex/artifacts/", "residency/disk.py")),
    (
        "acquire (residency)",
        (
            "loraplex/engines/vllm/residency",
            "loraplex/engines/vllm/slots.py",
            "loraplex/residency/",
        ),
    ),
    ("loraplex serving layer", ("loraplex/",)),
    ("vLLM front end (API process)", ("vllm/",)),
    ("HTTP server", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools/")),
)
API_OTHER = "event loop, other (API process)"
ENGINE_PARTS = (
    (
        "engine: model forward",
        (
            "torch/",
            "vllm/model_executor/",
            "vllm/lora/",
            "vllm/attention/",
            "vllm/v1/attention/",
            "loraplex/engines/vllm/patches.py",
            "loraplex/engines/native/model",
            "loraplex/engines/native/lora",
            "loraplex/models/",
            "loraplex/lora",
        ),
    ),
)
ENGINE_OTHER = "engine: step loop, scheduler, other"
HELPER = "helper processes"  # multiprocessing's resource tracker and the like
_PROCESS = re.compile(r'process (\d+):"([^"]*)";?')
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


def parse(text: str) -> Iterable[tuple[list[tuple[int, str]], list[str], int]]:
    """(process chain [(pid, cmdline)], frame files root to leaf, samples) per collapsed line."""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        processes = []
        while match := _PROCESS.match(stack):  # a command line may hold ";"
            processes.append((int(match[1]), match[2]))
            stack = stack[match.end() :]
        files = []
        for frame in stack.split(";") if stack else []:
            match = _FRAME.match(frame)
            files.append(match[2] if match else frame)
        yield processes, files, int(count)


def part_of(files: list[str], parts, other: str) -> str:
    for path in reversed(files):
        for part, fragments in parts:
            if any(f in path for f in fragments):
                return part
    return other


def attribute(text: str, api_pid: int, rate_hz: float) -> dict:
    """Samples and CPU seconds (samples / rate) per part and per process role."""
    parts: Counter[str] = Counter()
    roles: Counter[str] = Counter()
    for processes, files, count in parse(text):
        pid, cmdline = processes[-1] if processes else (api_pid, "")
        if pid == api_pid:
            role, part = "api", part_of(files, API_PARTS, API_OTHER)
        elif "resource_tracker" in cmdline or "semaphore_tracker" in cmdline:
            role, part = "helper", HELPER
        else:
            role, part = "engine", part_of(files, ENGINE_PARTS, ENGINE_OTHER)
        parts[part] += count
        roles[role] += count
    total = sum(parts.values()) or 1
    return {
        "rate_hz": rate_hz,
        "samples": sum(parts.values()),
        "parts": {
            p: {"samples": n, "cpu_s": round(n / rate_hz, 2), "share": round(n / total, 3)}
            for p, n in parts.most_common()
        },
        "roles": {r: {"samples": n, "share": round(n / total, 3)} for r, n in roles.most_common()},
    }


def top_frames(text: str, api_pid: int, limit: int = 15) -> list[tuple[str, int]]:
    """The API process's leaf functions by samples (what `attribute` sums, one level down)."""
    leaves: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        pid = api_pid
        while match := _PROCESS.match(stack):
            pid, stack = int(match[1]), stack[match.end() :]
        if pid == api_pid and stack:
            leaves[stack.split(";")[-1]] += int(count)
    return leaves.most_common(limit)
