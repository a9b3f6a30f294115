"""The audit log: one JSON line per inference request. Never the prompt or completion text."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

FIELDS = (
    "ts",
    "request_id",
    "endpoint",
    "tenant",
    "base_model",
    "adapter",
    "revision",
    "digest",
    "rank",
    "cache_tier",
    "queue_wait_ms",
    "load_ms",
    "ttft_ms",
    "tpot_ms",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "status",
    "error_code",
)


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # as json.dumps, without building one a line


class AuditLog:
    """Appends to a file (created with its parents), or writes to stdout for `-`; None writes
    nothing.

    The lines written on an event loop go out together at the end of its turn, one write for every
    request that ended in it: a process killed meanwhile loses that turn's lines, no others. A line
    written elsewhere (no loop running on the thread) goes out at once."""

    def __init__(self, target: str | Path | None):
        self.target = target
        self._lock = threading.Lock()
        self._lines: list[str] = []
        if target is None:
            self._out = None
        elif str(target) == "-":
            self._out = sys.stdout
        else:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            self._out = open(target, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._out is None:
            return
        line = _ENCODER.encode({k: record.get(k) for k in FIELDS}) + "\n"
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            if loop is not None and not self._lines:
                loop.call_soon(self.flush)
            self._lines.append(line)
        if loop is None:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            if lines and self._out is not None:
                self._out.write("".join(lines))
                self._out.flush()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._out is not None:
                if self._out is not sys.stdout:
                    self._out.close()
                self._out = None
