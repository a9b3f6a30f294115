"""`serve` as a real process: --port 0, --lora-modules, keys and admin files, graceful SIGTERM,
fail-fast."""

import json
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from harness import ADMIN_TOKEN, KEYS


def _serve(args: list, tmp_path):
    stderr = open(tmp_path / "stderr.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "loraplex.server.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def _address(proc, timeout: float = 180.0) -> str:
    """The URL from the line `loraplex serving NAME on URL`, read with a bound."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving"):
                found.append(line.rsplit(" ", 1)[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        raise AssertionError("serve did not print its address")
    return found[0]


@pytest.fixture
def files(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    return keys, token


def test_serve_process_end_to_end_with_graceful_sigterm(llama_dir, llama_adapters, files, tmp_path):
    keys, token = files
    data = tmp_path / "data"
    proc = _serve(
        [
            "--model",
            llama_dir,
            "--served-model-name",
            "base",
            "--port",
            "0",
            "--data-dir",
            data,
            "--lora-modules",
            f"one={llama_adapters['attn-r8']}",
            f"two={llama_adapters['mlp-r4']}",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--api-keys",
            keys,
            "--admin-token-file",
            token,
        ],
        tmp_path,
    )
    try:
        url = _address(proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["bob"], max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["base", "one", "two"]
        for model in ("base", "one", "two"):
            assert (
                client.completions.create(
                    model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
                ).usage.completion_tokens
                == 2
            )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{url}/v1", api_key="nope-nope-nope-nope", max_retries=0
            ).models.list()
        state = httpx.get(f"{url}/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert state.status_code == 200
        assert "loraplex_requests_total" in httpx.get(f"{url}/metrics").text

        # SIGTERM with a stream in flight: the stream completes, the process exits 0
        stream = client.chat.completions.create(
            model="one",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0
        rows = [json.loads(line) for line in (data / "audit.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and rows[-1]["status"] == 200 and rows[-1]["completion_tokens"] == 40
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_lora_module_stops_serve_with_exit_code_2_and_one_line(
    llama_dir, llama_adapters, tmp_path
):
    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(llama_adapters["attn-r8"] / "adapter_config.json", bad)
    (bad / "adapter_model.bin").write_bytes(b"not really a pickle")
    proc = _serve(
        [
            "--model",
            llama_dir,
            "--port",
            "0",
            "--data-dir",
            tmp_path / "data",
            "--dtype",
            "float32",
            "--lora-modules",
            f"good={llama_adapters['mlp-r4']}",
            f"bad={bad}",
        ],
        tmp_path,
    )
    try:
        assert proc.wait(180) == 2
        lines = (tmp_path / "stderr.log").read_text().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("error: --lora-modules bad:") and "pickle" in lines[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_other_base_model_name_warns_at_start_and_refuses_only_when_strict(
    llama_dir, llama_adapters, tmp_path
):
    """Trained on a hub id, served from a directory named otherwise: the shapes fit: it serves."""
    hub_named = tmp_path / "hub-named"
    shutil.copytree(llama_adapters["attn-r8"], hub_named)
    config = json.loads((hub_named / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    (hub_named / "adapter_config.json").write_text(json.dumps(config))
    args = [
        "--model",
        llama_dir,
        "--port",
        "0",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"hub={hub_named}",
    ]
    proc = _serve([*args, "--data-dir", tmp_path / "strict", "--strict-base-model-name"], tmp_path)
    try:
        assert proc.wait(180) == 2
        lines = (tmp_path / "stderr.log").read_text().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("error: --lora-modules hub:")
        assert "trained on 'meta-llama/Llama-3.1-8B-Instruct'" in lines[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc = _serve([*args, "--data-dir", tmp_path / "lenient"], tmp_path)
    try:
        url = _address(proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(
            model="hub", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert done.usage.completion_tokens == 2
        warnings = [
            line
            for line in (tmp_path / "stderr.log").read_text().splitlines()
            if "trained on 'meta-llama/Llama-3.1-8B-Instruct'" in line
        ]
        assert len(warnings) == 1 and "--strict-base-model-name" in warnings[0]
    finally:
        proc.terminate()
        proc.wait(60)
