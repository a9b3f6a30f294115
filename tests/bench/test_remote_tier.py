"""The remote tier of bench/vs_vllm.py: the throttled store counts each fetch, and plain vLLM's
plugin downloads an artifact byte for byte and drops its copy after vLLM's load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from shaped_store import serve_shaped  # noqa: E402
from vllm_remote_plugin import _download  # noqa: E402

from loraplex.artifacts import ArtifactStore, artifact_files, canonical_digest  # noqa: E402


@pytest.fixture
def store(tmp_path, llama_adapters):
    remote = ArtifactStore(tmp_path / "remote")
    src = next(iter(llama_adapters.values()))
    digest = remote.put(src)
    url, server = serve_shaped(remote.root)
    yield url, digest, src
    server.shutdown()
    server.server_close()


def test_a_download_is_the_artifact_and_each_fetch_is_counted(store, tmp_path):
    url, digest, src = store
    hex_digest = digest.removeprefix("sha256:")
    for n in (1, 2):
        _download(f"{url}/{hex_digest}", tmp_path / "copy")
        assert canonical_digest(tmp_path / "copy") == digest
        assert json.loads(httpx.get(f"{url}/fetches").text) == {hex_digest: n}
    assert artifact_files(tmp_path / "copy") == artifact_files(src)


def test_the_worker_load_fetches_a_missing_copy_and_drops_it(store, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import vllm_remote_plugin
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    url, digest, _ = store
    table = tmp_path / "table.json"
    root = tmp_path / "vllm-remote"
    urls = {"hot-0": f"{url}/{digest.removeprefix('sha256:')}"}
    table.write_text(json.dumps({"dir": str(root), "urls": urls}))
    monkeypatch.setenv("LORAPLEX_BENCH_REMOTE", str(table))
    seen = []
    monkeypatch.setattr(
        WorkerLoRAManager,
        "_load_adapter",
        lambda self, req: seen.append(canonical_digest(req.lora_path)) or "loaded",
    )
    vllm_remote_plugin.register()  # wraps the (stand-in) load above
    load = WorkerLoRAManager._load_adapter
    request = LoRARequest("hot-0", 1, str(root / "hot-0"))
    assert load(None, request) == "loaded" and seen == [digest]
    assert not (root / "hot-0").exists()  # no local copy beyond vLLM's host cache
    assert json.loads(httpx.get(f"{url}/fetches").text) == {digest.removeprefix("sha256:"): 1}
