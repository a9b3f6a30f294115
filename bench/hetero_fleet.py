"""A fleet of two bases behind one router: misrouted requests, wrong answers, bare-base requests.

    python bench/hetero_fleet.py [--engine native|vllm|both] [--vllm-workers-per-base N]
        [--requests 200] [--json bench/results/hetero_fleet.json]

Two tiny bases built here (a Llama and a Qwen2, head size 64 so vLLM's CPU attention takes them),
ten PEFT adapters of each (ranks 4 to 16) registered in one SQLite registry, each revision with its
own base. Per engine: `loraplex serve` workers (two per base; `--vllm-workers-per-base` for vLLM),
one `loraplex router` with one pool per base (`base-model`, `max-rank 16`) and the registry. The
requests go over the 20 adapter names and both bare bases from four closed-loop clients.

- misrouted: requests that reached a worker of the other base, counted from each worker's own audit
  log (one line per request it received, with the model it was asked for and the status it gave)
  and, for each answer, from the router's `x-loraplex-pool` / `x-loraplex-worker` headers;
- right: greedy token ids equal to HF transformers + PEFT's for that adapter (or bare base);
- bare base: the bare-base requests of each base and how many came back right.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinymodels import make_adapter, make_model, peft_reference, reference_greedy

from loraplex.loadgen.procs import start_router, start_together, start_worker, stop_together
from loraplex.registry import Registry

BASES = {"llama": "base-llama", "qwen2": "base-qwen"}
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
LORA = [
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
]
PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 6


def build(root: Path, per_base: int) -> tuple[str, dict[str, Path], dict[str, str], dict]:
    """(registry URL, base dirs, model name -> its base, model name -> reference ids)."""
    registry = Registry(f"sqlite:///{root / 'registry.db'}")
    registry.init()
    dirs, base_of, expected = {}, {}, {}
    for kind, served in BASES.items():
        dirs[kind] = make_model(root / kind, kind, **SHAPE)
        named = {
            f"{kind[:2]}{i:02d}": make_adapter(
                dirs[kind], root / f"{kind}-{i}", seed=i + 1, **LORA[i % len(LORA)]
            )
            for i in range(per_base)
        }
        for name, path in named.items():
            registry.add_revision(path, name, "r1", status="stable", base_model_dir=dirs[kind])
        reference = peft_reference(dirs[kind], named)
        for name in (None, *named):
            expected[name or served] = reference_greedy(reference, PROMPT, name, TOKENS)
            base_of[name or served] = kind
    url = registry.url
    registry.close()
    return url, dirs, base_of, expected


def start_fleet(root: Path, engine: str, per_base: int, registry_url: str, dirs: dict):
    """The workers (url -> base) and the router with a pool per base."""
    starts, kinds = [], []
    for kind, served in BASES.items():
        for i in range(per_base):
            extra = ["--registry", registry_url, "--served-model-name", served]
            extra += ["--max-loras", "4"]
            if engine == "vllm":
                extra += ["--engine", "vllm", "--max-cpu-loras", "8"]
                extra += ["--vllm-arg=--max-model-len=128"]

            def start(kind=kind, i=i, extra=extra):
                folder = root / f"{kind}{i}"
                return start_worker(dirs[kind], folder, {}, *extra, ready_timeout_s=900)

            starts.append(start)
            kinds.append(kind)
    # vLLM's CPU engine takes minutes to start on a busy 2-core machine: one at a time
    workers = start_together(starts) if engine == "native" else start_each(starts)
    pools = [
        {
            "name": f"pool-{kind}",
            "base-model": BASES[kind],
            "max-rank": 16,
            "workers": [w.url for w, k in zip(workers, kinds) if k == kind],
        }
        for kind in BASES
    ]
    (root / "router.yaml").write_text(yaml.safe_dump({"pool": pools}))
    try:
        router = start_router(
            [], root / "router", "affinity", "--config", str(root / "router.yaml"),
            "--registry", registry_url,
        )  # fmt: skip
    except RuntimeError:
        stop_together(workers)
        raise
    wait_for_health(router.url)
    return workers, dict(zip((w.url for w in workers), kinds)), router


def start_each(starts: list) -> list:
    started = []
    try:
        for start in starts:
            started.append(start())
    except RuntimeError:
        stop_together(started)
        raise
    return started


def wait_for_health(url: str, timeout: float = 120.0) -> None:
    """Until `url`/health answers 200 (the router prints its address before it listens)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer /health in {timeout:.0f} s")


def send(url: str, models: list[str], clients: int) -> list[tuple[str, httpx.Response | str]]:
    """Every model once, from `clients` closed-loop threads."""
    results: list[tuple[str, httpx.Response | str]] = []
    queue = list(enumerate(models))
    lock = threading.Lock()

    def client():
        with httpx.Client(timeout=300) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    _, model = queue.pop()
                body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS}
                body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
                try:
                    results.append((model, http.post(f"{url}/v1/completions", json=body)))
                except httpx.HTTPError as exc:
                    results.append((model, type(exc).__name__))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def audit_misrouted(root: Path, kind_of_dir: dict[str, str], base_of: dict) -> tuple[int, int]:
    """(requests the workers' audit logs record, of those asked of a worker of another base)."""
    seen = wrong = 0
    for folder, kind in kind_of_dir.items():
        path = root / folder / "audit.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in map(json.loads, lines):
            seen += 1
            model = line.get("adapter") or line.get("base_model")
            wrong += base_of.get(model) != kind or line.get("status") == 404
    return seen, wrong


def run_engine(root: Path, engine: str, per_base: int, n: int, built) -> dict:
    registry_url, dirs, base_of, expected = built
    names = sorted(base_of)
    models = [names[i % len(names)] for i in range(n)]  # each name about equally often
    random.Random(7).shuffle(models)
    workers, kind_of, router = start_fleet(root, engine, per_base, registry_url, dirs)
    try:
        results = send(router.url, models, clients=4)
    finally:
        router.stop()
        stop_together(workers)
    ok = [(m, r) for m, r in results if not isinstance(r, str) and r.status_code == 200]
    right = [m for m, r in ok if r.json()["choices"][0]["token_ids"] == expected[m]]
    header_wrong = sum(
        r.headers.get("x-loraplex-pool") != f"pool-{base_of[m]}"
        or kind_of.get(r.headers.get("x-loraplex-worker", "")) != base_of[m]
        for m, r in ok
    )
    folders = {f"{kind}{i}": kind for kind in BASES for i in range(per_base)}
    logged, audit_wrong = audit_misrouted(root, folders, base_of)
    bare = {served: (models.count(served), right.count(served)) for served in BASES.values()}
    return {
        "engine": engine,
        "workers": 2 * per_base,
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(str(r if isinstance(r, str) else r.status_code) for _, r in results
                               if isinstance(r, str) or r.status_code != 200)),
        "right": len(right),
        "misrouted_by_header": header_wrong,
        "worker_audit_lines": logged,
        "misrouted_by_audit": audit_wrong,
        "bare_base_sent_right": bare,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("native", "vllm", "both"), default="both")
    parser.add_argument("--vllm-workers-per-base", type=int, default=2)
    parser.add_argument("--adapters-per-base", type=int, default=10)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", default="bench/results/hetero_fleet.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engines = ("native", "vllm") if args.engine == "both" else (args.engine,)
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        built = build(tmp / "world", args.adapters_per_base)
        for engine in engines:
            per_base = 2 if engine == "native" else args.vllm_workers_per_base
            rows.append(run_engine(tmp / engine, engine, per_base, args.requests, built))
            console.log(rows[-1])
    table = Table(title="Two bases, one router, a pool per base")
    columns = ["engine", "workers", "requests", "ok", "right", "misrouted_by_header"]
    columns += ["misrouted_by_audit", "worker_audit_lines", "bare_base_sent_right"]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
