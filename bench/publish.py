"""Publish to ready on a fleet: a trainer publishes adapter versions from memory through the router
(`Publisher.publish_tensors(..., wait=True)`) to N `loraplex serve` workers on one registry, on
loopback.

    python bench/publish.py [--workers 4] [--publishes 20] [--rank 256] [--steady 200]
        [--steady-rank 256] [--keep 3] [--clients 2] [--quick] [--json OUT]

Shapes. The goal's adapter is Llama-3-8B's at rank 16 on all seven projections: 32 layers, 448
tensors, 83,886,080 bytes in bf16. A worker can only load an adapter that fits its base model,
and an 8B base does not fit this machine four times, so the workers serve a random Llama of the
same proportions scaled down 16 times in width (32 layers, hidden 256, intermediate 896, 8 heads,
2 key-value heads), and the adapter is rank 256 on it: the same 32 layers, the same 448 tensors
and the same 83,886,080 bytes in bf16, so every stage that goes by bytes or by tensors (upload,
digest, validation, store, the workers' loads) handles what the 8B adapter would give it.

Phase 1 (latency): `--publishes` versions, one at a time, each stable with `keep`, each waiting
for every worker to hold it; p50 and p99 of publish to ready, and the share of each stage: upload
(the body received and unpacked, as the worker times it), register (digest, validation, store,
record; split offline below), the workers' loads (the router's wait), and the rest (the client's
serializing, the router's forwarding). The register split: the same bytes through the same
functions in this process (`canonical_digest`, `read_adapter`,
`ArtifactStore.put_with_piece_lists`).

Phase 2 (steady): `--steady` more versions at `--keep` under `--clients` clients of traffic, each
asking by the bare name or by `name@rev` for one of the newest K-1 revisions it saw. Counted:
answers that name another revision (or digest) than asked (wrong), failures (not 200, other than a
404 for a revision retired before its request arrived, counted apart), workers' host memory (RSS,
sampled after every publish) against its level after the first K publishes, the adapter bytes each
worker holds, the artifacts of the name in the store (retirement deletes them; no `gc` runs), and
the registry's retired revisions.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

from loraplex.artifacts import ArtifactStore
from loraplex.client import Publisher
from loraplex.loadgen.procs import ADMIN_TOKEN, start_router, start_worker, state
from loraplex.model_config import LINEAR_MODULES, ModelConfig
from loraplex.registry import Registry

NAME = "policy"
DIGEST = "x-loraplex-adapter-digest"
SHAPE = dict(layers=32, hidden=256, intermediate=896, heads=8, kv_heads=2)
QUICK_SHAPE = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2)


def build_base(out: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int):
    import transformers

    from loraplex.demo.tokenizer import write_tokenizer_files

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=260,
        max_position_embeddings=256,
        eos_token_id=258,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    write_tokenizer_files(out)
    return out


def adapter_config(rank: int) -> dict:
    return {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LINEAR_MODULES),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def random_state(cfg: ModelConfig, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A version's LoRA tensors, PEFT's keys, random bf16."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in LINEAR_MODULES:
            d_in, d_out = cfg.linear_shape(module)
            prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
            a = torch.randn(rank, d_in, generator=gen) * 0.01
            b = torch.randn(d_out, rank, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    return tensors


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Fleet:
    """A registry file, N workers on it and a router, all on loopback."""

    def __init__(self, base: Path, root: Path, num_workers: int, max_rank: int):
        url = f"sqlite:///{root / 'registry.db'}"
        self.registry = Registry(url, base_model_dir=base, max_lora_rank=max_rank)
        self.registry.init()
        extra = ("--registry", url, "--max-loras", "2")
        self.workers = []
        try:
            for i in range(num_workers):  # one at a time: their model loads share two cores
                self.workers.append(
                    start_worker(base, root / f"w{i}", {}, *extra, max_lora_rank=max_rank)
                )
            self.router = start_router([w.url for w in self.workers], root / "router")
            _until(lambda: _answers(f"{self.router.url}/ready"))
        except BaseException:
            self.stop()
            raise

    def rss(self) -> list[int]:
        """Each worker's resident memory, its child processes included."""
        out = []
        for w in self.workers:
            proc = psutil.Process(w.p.pid)
            out.append(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]))
        return out

    def held_bytes(self) -> list[int]:
        """Each worker's bytes of the name's revisions in a slot or in host memory."""
        return [
            sum(
                a["bytes"]
                for a in state(w.url)["adapters"]
                if a["name"] == NAME and a["tier"] in ("gpu", "cpu")
            )
            for w in self.workers
        ]

    def stop(self) -> None:
        for proc in [getattr(self, "router", None), *self.workers]:
            if proc is not None:
                proc.stop()
        self.registry.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


def publish_once(publisher: Publisher, cfg: ModelConfig, rank: int, seed: int, keep: int) -> dict:
    """One version made, then published and waited for; its timings."""
    tensors = random_state(cfg, rank, seed)  # the trainer's step: not timed
    began = time.perf_counter()
    done = publisher.publish_tensors(
        NAME, tensors, adapter_config(rank), stable=True, keep=keep, wait=True
    )
    total = time.perf_counter() - began
    cutover = done.cutover
    assert cutover is not None
    timings = done.record["timings"]
    upload = timings["receive_s"]
    return {
        "revision": done.revision,
        "digest": done.digest,
        "ready": cutover.ready,
        "not_ready": [w.worker for w in cutover.not_ready],
        "total_s": total,
        "upload_s": upload,
        "register_s": timings["register_s"],
        "load_s": cutover.seconds,
        "load_max_worker_s": max(w.seconds for w in cutover.workers),
        "rest_s": max(0.0, total - upload - timings["register_s"] - cutover.seconds),
        "bytes": nbytes(tensors),
    }


def register_split(cfg_dir: Path, cfg: ModelConfig, rank: int, max_rank: int) -> dict:
    """Digest, validation and store of one version's bytes, in this process."""
    from safetensors.torch import save_file

    from loraplex.artifacts.digests import canonical_digest
    from loraplex.lora_format import read_adapter

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "adapter"
        src.mkdir()
        save_file(random_state(cfg, rank, 0), src / "adapter_model.safetensors")
        (src / "adapter_config.json").write_text(json.dumps(adapter_config(rank)))
        out = {}
        began = time.perf_counter()
        canonical_digest(src)
        out["digest_s"] = time.perf_counter() - began
        began = time.perf_counter()
        read_adapter(src, ModelConfig.from_dir(cfg_dir), max_rank)
        out["validation_s"] = time.perf_counter() - began
        began = time.perf_counter()
        ArtifactStore(Path(tmp) / "store").put_with_piece_lists(src)
        out["store_s"] = time.perf_counter() - began
    return out


def quantile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least `q` of the values at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_summary(rows: list[dict]) -> dict:
    totals = [r["total_s"] for r in rows]
    total = sum(totals)
    shares = {
        stage: sum(r[f"{stage}_s"] for r in rows) / total
        for stage in ("upload", "register", "load", "rest")
    }
    return {
        "publishes": len(rows),
        "p50_s": quantile(totals, 0.5),
        "p99_s": quantile(totals, 0.99),
        "mean_s": statistics.fmean(totals),
        "shares": shares,
        "all_ready": all(r["ready"] for r in rows),
    }


class Traffic:
    """Clients asking for the bare name or for one of the newest K-1 revisions published (a
    rollout under an older policy), each answer checked against what it asked for."""

    def __init__(self, url: str, keep: int, digests: dict[str, str], seed: int = 0):
        self.url, self.keep, self.digests = url, keep, digests
        self.published: list[str] = []  # revisions, oldest first
        self.counts = {"answers": 0, "wrong": 0, "failed": 0, "retired_404": 0}
        self.failures: list[str] = []
        self._answered: list[tuple[str, int, str, str | None]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, clients: int) -> None:
        for _ in range(clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _pick(self) -> tuple[str, int]:
        """The model to ask for, and the index (in `published`) of the oldest revision a right
        answer may name: the one asked for, or for the bare name the newest when it was sent."""
        with self._lock:
            newest = len(self.published) - 1
            if self._rng.random() < 0.5:
                return NAME, newest
            index = self._rng.randrange(max(0, newest - self.keep + 2), newest + 1)
            return f"{NAME}@{self.published[index]}", index

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                model, oldest = self._pick()
                body = {"model": model, "prompt": "x", "max_tokens": 2, "temperature": 0}
                try:
                    answer = http.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self._count("failed", f"{model}: {exc}")
                    continue
                self._check(model, oldest, answer)

    def _check(self, model: str, oldest: int, answer: httpx.Response) -> None:
        if answer.status_code == 404 and "@" in model:
            self._count("retired_404")
        elif answer.status_code != 200:
            self._count("failed", f"{model}: {answer.status_code} {answer.text[:200]}")
        else:
            named = answer.headers.get("x-loraplex-adapter", "")
            with self._lock:  # checked once every revision is known (`judge`)
                self._answered.append((model, oldest, named, answer.headers.get(DIGEST)))

    def judge(self) -> dict:
        """The counts, each answer checked: the revision it names is the one asked for (by
        `name@rev`) or no older than the newest when it was sent (by the bare name), and its
        digest is that revision's."""
        index = {revision: i for i, revision in enumerate(self.published)}
        for model, oldest, named, digest in self._answered:
            revision = named.split("@")[-1]
            asked_right = "@" not in model or model == named
            if index.get(revision, -1) < oldest or not asked_right:
                self._count("wrong", f"{model}: answered by {named}")
            elif self.digests[revision] != digest:
                self._count("wrong", f"{model}: {named} with digest {digest}")
            else:
                self._count("answers")
        return dict(self.counts)

    def _count(self, what: str, detail: str | None = None) -> None:
        with self._lock:
            self.counts[what] += 1
            if detail is not None and len(self.failures) < 20:
                self.failures.append(detail)

    def published_one(self, revision: str, digest: str) -> None:
        with self._lock:
            self.digests[revision] = digest
            self.published.append(revision)


def steady_phase(fleet: Fleet, publisher: Publisher, cfg, args, seed0: int) -> dict:
    """`args.steady` publishes at `args.keep` under traffic, with the samples the goal checks."""
    traffic = Traffic(fleet.router.url, args.keep, {})
    rss, held, stored, totals, not_ready, level = [], [], [], [], 0, None
    for i in range(args.steady):
        row = publish_once(publisher, cfg, args.steady_rank, seed0 + i, args.keep)
        traffic.published_one(row["revision"], row["digest"])
        totals.append(row["total_s"])
        not_ready += not row["ready"]
        if i == 0:
            traffic.start(args.clients)
        rss.append(fleet.rss())
        held.append(fleet.held_bytes())
        stored.append(artifacts_of_name(fleet.registry))
        if i == args.keep - 1:
            level = rss[-1]
    traffic.stop()
    counts = traffic.judge()
    assert level is not None, "--steady must be at least --keep"
    after = rss[args.keep :] or [level]
    growth = [max(s[w] for s in after) / level[w] for w in range(len(level))]
    one = revision_host_bytes(fleet)
    return {
        "publishes": args.steady,
        "keep": args.keep,
        "p50_s": quantile(totals, 0.5),
        "p99_s": quantile(totals, 0.99),
        "not_ready": not_ready,
        **counts,
        "failures": traffic.failures,
        "rss_level_after_k": level,
        "rss_max_over_level": growth,
        "rss_final_over_level": [after[-1][w] / level[w] for w in range(len(level))],
        "rss_series": rss,
        "held_max_bytes": max(max(h) for h in held),
        "revision_host_bytes": one,
        "held_max_over_k_revisions": max(max(h) for h in held) / (args.keep * one),
        "store_max_artifacts_of_name": max(stored),
        **registry_counts(fleet.registry, args.keep),
    }


def artifacts_of_name(registry: Registry) -> int:
    revisions = registry.show(NAME, retired=True).revisions
    return len({r.digest for r in revisions if registry.store.has(r.digest)})


def revision_host_bytes(fleet: Fleet) -> int:
    rows = [a for a in state(fleet.workers[0].url)["adapters"] if a["name"] == NAME and a["bytes"]]
    return max(a["bytes"] for a in rows)


def registry_counts(registry: Registry, keep: int) -> dict:
    every = registry.show(NAME, retired=True).revisions
    kept = registry.show(NAME).revisions
    retire_events = [e for e in registry.audit_events(100_000, NAME) if e.action == "retire"]
    return {
        "registry_revisions": len(every),
        "registry_not_retired": len(kept),
        "registry_retired": sum(r.status == "retired" for r in every),
        "retire_events": len(retire_events),
        "retired_as_set": len(kept) == keep
        and [r.revision for r in kept] == [r.revision for r in every[-keep:]],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--publishes", type=int, default=20, help="phase 1: waited publishes")
    parser.add_argument("--rank", type=int, default=256, help="phase 1's adapter rank")
    parser.add_argument("--steady", type=int, default=200, help="phase 2: publishes under traffic")
    parser.add_argument("--steady-rank", type=int, default=256)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny base and sizes (smoke test)")
    parser.add_argument("--json", type=Path, help="default: bench/results/publish.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.publishes, args.rank = min(args.workers, 2), 3, 8
        args.steady, args.steady_rank, args.clients = 5, 8, 1
    if args.json is None:
        args.json = Path(f"bench/results/publish{'.quick' if args.quick else ''}.json")
    return args


def run(args: argparse.Namespace, work: Path) -> dict:
    shape = QUICK_SHAPE if args.quick else SHAPE
    base = build_base(work / "base", **shape)
    cfg = ModelConfig.from_dir(base)
    max_rank = max(args.rank, args.steady_rank)
    fleet = Fleet(base, work, args.workers, max_rank)
    try:
        with Publisher(fleet.router.url, ADMIN_TOKEN) as publisher:
            rows = [
                publish_once(publisher, cfg, args.rank, i, args.keep) for i in range(args.publishes)
            ]
            steady = steady_phase(fleet, publisher, cfg, args, seed0=10_000)
    finally:
        fleet.stop()
    return {
        "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/publish.py " + " ".join(sys.argv[1:]),
        "shape": shape,
        "workers": args.workers,
        "adapter_bytes": rows[0]["bytes"] if rows else None,
        "latency": latency_summary(rows),
        "register_split": register_split(base, cfg, args.rank, max_rank),
        "rows": rows,
        "steady": steady,
    }


def print_table(result: dict) -> None:
    lat, split, st = result["latency"], result["register_split"], result["steady"]
    print(f"{result['workers']} workers, adapter {result['adapter_bytes']:,} bytes bf16")
    print(
        f"| publish to ready | p50 {lat['p50_s']:.3f} s | p99 {lat['p99_s']:.3f} s | "
        f"n {lat['publishes']} | all ready {lat['all_ready']} |"
    )
    print("| share | " + " | ".join(f"{k} {v:.0%}" for k, v in lat["shares"].items()) + " |")
    print("| register, offline | " + " | ".join(f"{k} {v:.3f} s" for k, v in split.items()) + " |")
    print(
        f"| {st['publishes']} at keep {st['keep']} | p50 {st['p50_s']:.3f} s"
        f" | p99 {st['p99_s']:.3f} s | answers {st['answers']} | wrong {st['wrong']}"
        f" | failed {st['failed']} | 404 retired {st['retired_404']} | not ready "
        f"{st['not_ready']} |"
    )
    print(
        f"| memory | RSS max/level after K {max(st['rss_max_over_level']):.3f} | end/level "
        f"{max(st['rss_final_over_level']):.3f} | held/K revisions "
        f"{st['held_max_over_k_revisions']:.3f} | store artifacts of name max "
        f"{st['store_max_artifacts_of_name']} | retired as set {st['retired_as_set']} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="publish-bench-") as tmp:
        result = run(args, Path(tmp))
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
