"""A worker's artifact store on a PostgreSQL registry: with neither `--storage-base` nor `--store`,
what it would register lands on its own disk only, so it refuses every registration (its
`--lora-modules` at start, an upload over the admin API) with one message naming both, and
records nothing. Real `serve` processes on a throwaway PostgreSQL cluster."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
from test_publish import TAR, archive, files_of

from loraplex.registry import Registry

ADMIN_TOKEN = "admin-token-0123456789"


def _refusal(data_dir) -> str:
    return (
        f"the registry is a server database, but revisions would be stored in {data_dir}/artifacts "
        "on this machine only, where workers cannot read them: give --storage-base with the "
        "cluster's store (oci://HOST/REPOSITORY or s3://BUCKET/PREFIX, which revisions are "
        "uploaded to), or --store DIR "
        "on a volume the workers mount at the same path"
    )


def _recorded(pg_url) -> list[str]:
    registry = Registry(pg_url, create=False)
    try:
        return [a.name for a in registry.list_adapters()]
    finally:
        registry.close()


def test_lora_modules_on_postgresql_without_a_store_stop_serve_naming_the_store_flags(
    pg_url, llama_dir, llama_adapters, tmp_path
):
    data = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", "--model", llama_dir, "--registry", pg_url]
        + ["--data-dir", data, "--lora-modules", f"sql={llama_adapters['attn-r8']}"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: --lora-modules sql: {_refusal(data)}\n"
    assert _recorded(pg_url) == []
    assert not (data / "artifacts" / "sha256").exists()


def test_an_upload_to_a_worker_whose_store_only_it_reads_is_refused_and_records_nothing(
    pg_url, llama_dir, llama_adapters, tmp_path
):
    data = tmp_path / "data"
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    command = ["serve", "--model", llama_dir, "--registry", pg_url, "--data-dir", data]
    command += ["--port", "0", "--admin-token-file", token, "--engine-core", "thread"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = _served_url(proc)
        response = httpx.post(
            f"{url}/admin/adapters/up/upload",
            params={"stable": "true"},
            content=archive(_adapter_files(llama_adapters["attn-r8"])),
            headers={**TAR, "Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=60,
        )
    finally:
        proc.terminate()
        proc.wait(60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == _refusal(data)
    assert _recorded(pg_url) == []
    assert not [p for p in (data / "artifacts").rglob("*") if p.is_file()]


def _adapter_files(directory) -> dict[str, bytes]:
    return {
        name: data
        for name, data in files_of(directory).items()
        if name == "adapter_config.json" or name.endswith(".safetensors")
    }


def _served_url(proc, timeout: float = 180.0) -> str:
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving"):
                found.append(line.rsplit(" ", 1)[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, "serve did not print its address"
    return found[0]
