"""A static HTTP artifact store with a fixed latency per request and a bandwidth cap: the remote
tier of the benchmarks. `serve_shaped` runs it on a thread of the calling process;
`shaped_store_process` in a process of its own, as a real remote store is, so that its work never
shares the interpreter (and its GIL) with the engine.

    python bench/shaped_store.py ROOT [LATENCY_S BYTES_PER_S]  # serves ROOT/sha256, prints its URL

`GET /fetches` answers how many times each artifact's index was read, one per fetch, as JSON.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


class Fetches:
    """Index reads per artifact (its `<hex>` directory), counted across the server's threads."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def add(self, hex_digest: str) -> None:
        with self.lock:
            self.counts[hex_digest] += 1

    def body(self) -> bytes:
        with self.lock:
            return json.dumps(self.counts).encode()


class ShapedHandler(http.server.SimpleHTTPRequestHandler):
    latency_s = 0.05
    bytes_per_s = 200e6

    def __init__(self, *args, fetches: Fetches, **kwargs):
        self.fetches = fetches  # before the base class, which answers the request in __init__
        super().__init__(*args, **kwargs)

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/fetches":
            body = self.fetches.body()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path.endswith("/index.json"):
            self.fetches.add(self.path.strip("/").split("/")[0])
        super().do_GET()

    def copyfile(self, source, outputfile):
        time.sleep(self.latency_s)
        while chunk := source.read(1 << 20):
            start = time.perf_counter()
            outputfile.write(chunk)
            time.sleep(max(0.0, len(chunk) / self.bytes_per_s - (time.perf_counter() - start)))


def serve_shaped(root: Path) -> tuple[str, http.server.ThreadingHTTPServer]:
    handler = functools.partial(ShapedHandler, directory=str(root / "sha256"), fetches=Fetches())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


@contextlib.contextmanager
def shaped_store_process(
    root: Path,
    latency_s: float = ShapedHandler.latency_s,
    bytes_per_s: float = ShapedHandler.bytes_per_s,
) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, str(root), str(latency_s), str(bytes_per_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the shaped store did not start (exit code {proc.poll()})")
        yield url
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        ShapedHandler.latency_s, ShapedHandler.bytes_per_s = map(float, sys.argv[2:4])
    url, server = serve_shaped(Path(sys.argv[1]))
    print(url, flush=True)
    threading.Event().wait()
