"""The audit log: one JSON line per inference request. Never the prompt or completion text."""

from __future__ import annotations

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


class AuditLog:
    """Appends to a file (created with its parents), or writes to stdout for `-`; None writes
    nothing."""

    def __init__(self, target: str | Path | None):
        self.target = target
        self._lock = threading.Lock()
        if target is None:
            self._out = None
        elif str(target) == "-":
            self._out = sys.stdout
        else:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            # line-buffered: one write per line
            self._out = open(target, "a", buffering=1, encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._out is None:
            return
        line = json.dumps({k: record.get(k) for k in FIELDS}, separators=(",", ":"))
        with self._lock:
            self._out.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._out is not None:
                self._out.flush()
                if self._out is not sys.stdout:
                    self._out.close()
                self._out = None
