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
    (  # vLLM's engine core spins (sched_yield) on the shared-memory queue to its worker
        "engine: busy-wait for the worker (vLLM's shm queue)",
        ("vllm/distributed/",),
    ),
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
IDLE_LEAVES = (  # (file, function prefix) of an innermost frame that blocks in C: a waiting thread
    ("threading.py", ""),
    ("selectors.py", ""),
    ("queue.py", ""),
    ("concurrent/futures/thread.py", "_worker"),
    ("multiprocessing/connection.py", ""),
    ("asyncio/runners.py", "Runner.run"),  # uvloop's loop, in C: waiting on its poll
    ("zmq/sugar/socket.py", "Socket.recv"),
    ("zmq/sugar/poll.py", ""),
)
_PROCESS = re.compile(r'process (\d+):"([^"]*)";?')
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


def parse(text: str) -> Iterable[tuple[list[tuple[int, str]], list[tuple[str, str]], int]]:
    """(process chain [(pid, cmdline)], frames [(function, file)] root to leaf, samples) per
    collapsed line."""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        processes = []
        while match := _PROCESS.match(stack):  # a command line may hold ";"
            processes.append((int(match[1]), match[2]))
            stack = stack[match.end() :]
        frames = []
        for frame in stack.split(";") if stack else []:
            match = _FRAME.match(frame)
            frames.append((match[1], match[2]) if match else (frame, ""))
        yield processes, frames, int(count)


def is_idle(frames: list[tuple[str, str]]) -> bool:
    """A thread blocked in a wait: its innermost Python frame is one of IDLE_LEAVES (py-spy drops
    most idle threads itself, not all)."""
    if not frames:
        return True
    function, path = frames[-1]
    return any(path.endswith(f) and function.startswith(fn) for f, fn in IDLE_LEAVES)


def part_of(frames: list[tuple[str, str]], parts, other: str) -> str:
    for _, path in reversed(frames):
        for part, fragments in parts:
            if any(f in path for f in fragments):
                return part
    return other


def role_of(processes: list[tuple[int, str]], api_pid: int) -> str:
    pid, cmdline = processes[-1] if processes else (api_pid, "")
    if pid == api_pid:
        return "api"
    if "resource_tracker" in cmdline or "semaphore_tracker" in cmdline:
        return "helper"
    return "engine"


def attribute(text: str, api_pid: int, cpu_s: dict[str, float] | None = None) -> dict:
    """Busy samples per part, each part's share of its process role's busy samples and, given
    the roles' CPU seconds (`cpu_s`: psutil's, {"api": s, "engine": s}), its CPU seconds: the
    role's CPU times the share. Idle-looking samples are counted apart per role."""
    busy: Counter[tuple[str, str]] = Counter()
    idle: Counter[str] = Counter()
    for processes, frames, count in parse(text):
        role = role_of(processes, api_pid)
        if is_idle(frames):
            idle[role] += count
            continue
        if role == "api":
            part = part_of(frames, API_PARTS, API_OTHER)
        else:
            part = part_of(frames, ENGINE_PARTS, ENGINE_OTHER) if role == "engine" else HELPER
        busy[(role, part)] += count
    per_role: Counter[str] = Counter()
    for (role, _), n in busy.items():
        per_role[role] += n
    parts = {}
    for (role, part), n in busy.most_common():
        share = n / per_role[role]
        parts[part] = {"role": role, "samples": n, "share_of_role": round(share, 3)}
        if cpu_s is not None and role in cpu_s:
            parts[part]["cpu_s"] = round(cpu_s[role] * share, 3)
    return {
        "busy_samples": dict(per_role),
        "idle_samples": dict(idle),
        "parts": parts,
    }


def root_pid(text: str) -> int | None:
    """The process py-spy was pointed at: the first process frame of the stacks."""
    for processes, _, _ in parse(text):
        if processes:
            return processes[0][0]
    return None


def top_frames(text: str, api_pid: int, limit: int = 15) -> list[tuple[str, int]]:
    """The API process's busy leaf functions by samples (what `attribute` sums, one level
    down)."""
    leaves: Counter[str] = Counter()
    for processes, frames, count in parse(text):
        if role_of(processes, api_pid) == "api" and not is_idle(frames):
            function, path = frames[-1]
            leaves[f"{function} ({path})"] += count
    return leaves.most_common(limit)
