"""The remote tier of `bench/vs_vllm.py` for plain vLLM: its adapters come from the same throttled
store as loraplex's, and it keeps no local copy of one beyond its host cache.

A `vllm.general_plugins` entry point (vs_vllm.py writes its metadata into a directory on
PYTHONPATH), so vLLM runs `register` in each of its processes. LORAPLEX_BENCH_REMOTE names a JSON
file `{"dir": DIR, "urls": {NAME: URL}}`. In the API server, a `LoRAResolver` (vLLM consults it for
a name it does not know, with VLLM_ALLOW_RUNTIME_LORA_UPDATING) downloads NAME from URL into
DIR/NAME on the server's event loop, as vLLM's hub resolver does, and vLLM adds it. In the worker,
vLLM's adapter load reads DIR/NAME and then deletes it; a load that finds it gone (a reload after
vLLM's LRU removed the adapter from its host cache) downloads it again first, within vLLM's load,
which is where vLLM reads every adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx

INDEX_FILE = "index.json"  # the store's file list (loraplex.artifacts.store)


def register() -> None:
    table = os.environ.get("LORAPLEX_BENCH_REMOTE")
    if not table:
        return
    spec = json.loads(Path(table).read_text())
    root, urls = Path(spec["dir"]), spec["urls"]
    root.mkdir(parents=True, exist_ok=True)
    from vllm.lora.resolver import LoRAResolverRegistry
    from vllm.lora.worker_manager import WorkerLoRAManager

    LoRAResolverRegistry.register_resolver("loraplex bench remote", _Resolver(root, urls))
    load = WorkerLoRAManager._load_adapter

    def load_from_store(self, lora_request):
        path = Path(lora_request.lora_path)
        ours = path.parent == root and path.name in urls
        if ours and not path.is_dir():
            _download(urls[path.name], path)
        try:
            return load(self, lora_request)
        finally:
            if ours:
                shutil.rmtree(path, ignore_errors=True)

    WorkerLoRAManager._load_adapter = load_from_store


class _Resolver:
    def __init__(self, root: Path, urls: dict[str, str]):
        self.root, self.urls = root, urls

    async def resolve_lora(self, base_model_name: str, lora_name: str):
        from vllm.lora.request import LoRARequest

        url = self.urls.get(lora_name)
        if url is None:
            return None
        path = self.root / lora_name
        async with httpx.AsyncClient(timeout=60) as client:
            index = (await client.get(f"{url}/{INDEX_FILE}")).raise_for_status().json()
            files = {}
            for f in index["files"]:
                r = await client.get(f"{url}/{f['name']}")
                files[f["name"]] = r.raise_for_status().content
        _write(path, files)
        return LoRARequest(lora_name, 1, str(path))


def _download(url: str, path: Path) -> None:
    with httpx.Client(timeout=60) as client:
        index = client.get(f"{url}/{INDEX_FILE}").raise_for_status().json()
        files = {
            f["name"]: client.get(f"{url}/{f['name']}").raise_for_status().content
            for f in index["files"]
        }
    _write(path, files)


def _write(path: Path, files: dict[str, bytes]) -> None:
    work = path.with_name(f".{path.name}.{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name, data in files.items():
        (work / name).write_bytes(data)
    shutil.rmtree(path, ignore_errors=True)
    work.rename(path)
