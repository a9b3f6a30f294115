"""Real `loraplex` processes on free loopback ports (tests and benchmarks); stop them when done."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ADMIN_TOKEN = "e2e-admin-token-0123456789"


class Proc:
    def __init__(self, args: list[str], log: Path, pattern: str = r"on (http://[0-9.:]+)"):
        self.args, self.log_path = args, log
        self.log = log.open("w")
        self.p = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *args], stdout=self.log,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            match = re.search(pattern, log.read_text())
            if match:
                self.url = match[1]
                return
            if self.p.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {self.p.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{args[0]} did not start:\n{log.read_text()[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int | None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        return self.p.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start_worker(model_dir: Path, data_dir: Path, adapters: dict[str, Path], *extra: str,
                 max_lora_rank: int = 16) -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["serve", "--model", str(model_dir), "--port", "0", "--data-dir", str(data_dir), "--dtype", "float32",
            "--admin-token-file", str(token_file), "--max-lora-rank", str(max_lora_rank), *extra]
    if adapters:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return Proc(args, data_dir / "log.txt")


def start_router(workers: list[str], data_dir: Path, policy: str = "affinity") -> Proc:
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["router", "--port", "0", "--policy", policy, "--admin-token-file", str(token_file)]
    for url in workers:
        args += ["--worker", url]
    return Proc(args, data_dir / "router-log.txt")


def state(url: str) -> dict:
    r = httpx.get(f"{url}/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    r.raise_for_status()
    return r.json()
