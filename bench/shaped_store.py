"""A static HTTP artifact store with a fixed latency per request and a bandwidth cap: the remote
tier of the benchmarks. `serve_shaped` runs it on a thread of the calling process;
`shaped_store_process` in a process of its own, as a real remote store is, so that its work never
shares the interpreter (and its GIL) with the engine.

    python bench/shaped_store.py ROOT    # serves ROOT/sha256, prints its URL
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class ShapedHandler(http.server.SimpleHTTPRequestHandler):
    latency_s = 0.05
    bytes_per_s = 200e6

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        time.sleep(self.latency_s)
        while chunk := source.read(1 << 20):
            start = time.perf_counter()
            outputfile.write(chunk)
            time.sleep(max(0.0, len(chunk) / self.bytes_per_s - (time.perf_counter() - start)))


def serve_shaped(root: Path) -> tuple[str, http.server.ThreadingHTTPServer]:
    handler = functools.partial(ShapedHandler, directory=str(root / "sha256"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


@contextlib.contextmanager
def shaped_store_process(root: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, str(root)], stdout=subprocess.PIPE, text=True
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
    url, server = serve_shaped(Path(sys.argv[1]))
    print(url, flush=True)
    threading.Event().wait()
