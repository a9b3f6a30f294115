"""Real `loraplex` processes on free loopback ports (tests and benchmarks); stop them when done."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

ADMIN_TOKEN = "e2e-admin-token-0123456789"


class Proc:
    """A `loraplex` command, its output copied to `log`; ready once a line matches `pattern`."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        pattern: str = r"on (http://[0-9.:]+)",
        ready_timeout_s: float = 180,
    ):
        self.args, self.log_path = args, log
        self.log = log.open("w")
        command = [sys.executable, "-m", "loraplex.cli", *args]
        self.p = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        address: Future[str | None] = Future()
        self._copier = threading.Thread(
            target=self._copy_output, args=(re.compile(pattern), address), daemon=True
        )
        self._copier.start()
        try:
            url = address.result(timeout=ready_timeout_s)
        except TimeoutError:
            url = None
        if url is None:
            exited = self.p.poll()
            self.stop()
            what = "did not start" if exited is None else f"exited {exited}"
            raise RuntimeError(f"{args[0]} {what}:\n{log.read_text()[-3000:]}")
        self.url = url

    def _copy_output(self, pattern: re.Pattern, address: Future) -> None:
        """Copy every output line to the log, and the first match of `pattern` to `address` (None
        when the output ends first: the process exited)."""
        for line in self.p.stdout:
            if not self.log.closed:  # a child that outlives the stop may still hold the pipe
                self.log.write(line)
                self.log.flush()
            match = pattern.search(line)
            if match and not address.done():
                address.set_result(match[1])
        if not address.done():
            address.set_result(None)

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int | None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._copier.join(10)  # the rest of the output, up to the end of the pipe
        self.log.close()
        return self.p.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start_together(starts: list[Callable[[], Proc]]) -> list[Proc]:
    """Run each start at once and wait for all (their imports and model loads overlap); when one
    fails, stop the others and raise its error."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for proc in started:
            proc.stop()
        raise errors[0]
    return started


def stop_together(procs: list[Proc]) -> None:
    """Stop each at once (each drains and stops its engine), and wait for all."""
    with ThreadPoolExecutor(max(len(procs), 1)) as pool:
        list(pool.map(Proc.stop, procs))


def start_worker(
    model_dir: Path,
    data_dir: Path,
    adapters: dict[str, Path],
    *extra: str,
    max_lora_rank: int = 16,
    ready_timeout_s: float = 180,
) -> Proc:
    """`ready_timeout_s`: how long it may take to print its address (vLLM's CPU engine takes
    minutes on a busy machine)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--dtype",
        "float32",
        "--admin-token-file",
        str(token_file),
        "--max-lora-rank",
        str(max_lora_rank),
        *extra,
    ]
    if adapters:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return Proc(args, data_dir / "log.txt", ready_timeout_s=ready_timeout_s)


def start_router(workers: list[str], data_dir: Path, policy: str = "affinity", *extra: str) -> Proc:
    """`extra`: more `router` arguments (`--config FILE`, `--registry URL`, ...)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["router", "--port", "0", "--policy", policy, "--admin-token-file", str(token_file)]
    for url in workers:
        args += ["--worker", url]
    args += extra
    return Proc(args, data_dir / "router-log.txt")


def start_placement(registry: str, workers: list[str], data_dir: Path, *extra: str) -> Proc:
    """`loraplex placement` over `workers`, its metrics on a free port (its `url`); `extra`: more
    of its arguments (the policy's, `--interval-s`, `--lease-s`, ...)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    token_file = data_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["placement", "--registry", registry, "--admin-token-file", str(token_file)]
    for url in workers:
        args += ["--worker", url]
    return Proc([*args, "--metrics-port", "0", *extra], data_dir / "log.txt")


def state(url: str) -> dict:
    r = httpx.get(
        f"{url}/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    r.raise_for_status()
    return r.json()


def prefix_cache(url: str) -> tuple[float, float]:
    """A worker's prefix-cache counts from its /metrics, vLLM's series: (tokens looked up, tokens
    found)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = dict(re.findall(r"^vllm:prefix_cache_(queries|hits)(?:_total)?\s+(\S+)$", text, re.M))
    return float(found.get("queries", 0)), float(found.get("hits", 0))
