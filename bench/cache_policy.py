"""Cache policies in the real engine: the seed scenario and Zipf workloads, `lru` vs `score`.

    python bench/cache_policy.py [--quick] [--seeds 3] [--threads 1]
        [--workloads hot-burst,no-burst] [--device cpu|cuda] [--seconds 20] [--rate 4]
        [--json bench/results/cache_policy.json]

Each workload is replayed open-loop against an LLMEngine (arrivals at their trace times, the step
loop running as fast as it can): time to first token is measured from a request's arrival to its
first token. Two set-ups:
`disk` (every adapter on local disk; an eviction costs a disk reload) and `remote` (a disk budget of
a few adapters, so evicted adapters fall back to a real local HTTP store in its own process, with 50
ms latency and 200 MB/s). Every workload runs once per seed (its own arrivals); a row pools the
requests of all seeds, so a p99 rests on a few slow requests rather than on the slowest one. The
seed scenario starts with its hot adapters loaded (their cold start is not what it measures).
`burst-compute` is its control: the burst's requests at the same times but on the hot adapters, so
the compute they add without any load or eviction. `shift` is a change of traffic: the seed
scenario, then Zipf(0.9) over other adapters at 4 requests/s for three times as long, on the same
engine (how soon the cache stops favouring the adapters whose traffic stopped); `shift-control`
replays the same Zipf requests on a fresh engine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from adapter_load import write_adapter
from shaped_store import ShapedHandler, shaped_store_process

from loraplex.artifacts import ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.model_config import ModelConfig
from loraplex.residency.key import AdapterKey, AdapterRef

RANKS = (8, 16, 32, 64)
CONTROLS = ("no-burst", "burst-compute", "shift-control")


def build_model(out: Path) -> Path:
    import transformers

    from loraplex.demo.tokenizer import write_tokenizer_files

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=260,
        max_position_embeddings=512,
        eos_token_id=258,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    write_tokenizer_files(out)
    return out


def hot_burst(
    num_hot: int, num_cold: int, seconds: float, rate: float, rng: random.Random
) -> list[tuple]:
    """Steady traffic on a few hot adapters, then a batch tenant sweeping cold adapters once
    each."""
    trace, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        trace.append((t, f"hot{rng.randrange(num_hot)}", "hot"))
    burst_start, burst_end = seconds / 3, 2 * seconds / 3
    for i in range(num_cold):
        trace.append((burst_start + (burst_end - burst_start) * i / num_cold, f"cold{i}", "cold"))
    return sorted(trace)


def zipf(num_adapters: int, alpha: float, n: int, rate: float, rng: random.Random) -> list[tuple]:
    weights = [1 / (i + 1) ** alpha for i in range(num_adapters)]
    trace, t = [], 0.0
    names = [f"z{i}" for i in range(num_adapters)]
    for _ in range(n):
        t += rng.expovariate(rate)
        index = rng.choices(range(num_adapters), weights)[0]
        trace.append((t, names[index], "hot" if index < 4 else "tail"))
    return trace


def replay(
    engine: LLMEngine, trace: list[tuple], refs: dict[str, AdapterRef], prompt: list[int]
) -> list[dict]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    pending, by_id = list(trace), {}
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, name, group = pending.pop(0)
            rid = engine.add_request(prompt, params, refs[name])
            by_id[rid] = {"arrival": at, "adapter": name, "group": group}
        for out in engine.step():
            record = by_id[out.request_id]
            if "tier" not in record:
                record["tier"] = out.cache_tier
                record["ttft"] = time.perf_counter() - start - record["arrival"]
            if out.error is not None:
                record["error"] = str(out.error)
        if not engine.scheduler.running:
            # Nothing to compute: wait for an arrival or a load, as the server's step loop does
            # (AsyncEngine). A loop that steps again at once holds the GIL the load threads need (a
            # 2 MB load takes 3-4 s so).
            wait = 0.001 if engine.adapters.loading or not pending else 0.002
            if pending:
                wait = min(wait, max(0.0, pending[0][0] - (time.perf_counter() - start)))
            time.sleep(wait)
    return list(by_id.values())


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return (
        round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)
        if values
        else float("nan")
    )


def summarize(runs: list[tuple[list[dict], dict]], window: tuple[float, float] | None) -> dict:
    """One row over every seed's run: `runs` holds each run's records and its cache counters."""
    records = [r for recs, _ in runs for r in recs]
    tiers = [r["tier"] for r in records]
    hot = [r for r in records if r["group"] == "hot"]
    shifted = [r for r in records if r["group"] == "shifted"]

    def during_burst(r) -> bool:
        return window is not None and window[0] <= r["arrival"] <= window[1]

    def in_window(recs):
        return [r["ttft"] for r in recs if r["group"] == "hot" and during_burst(r)]

    return {
        "requests": len(records),
        "errors": sum("error" in r for r in records),
        **{
            f"hit_{t}": round(tiers.count(t) / len(tiers), 3)
            for t in ("gpu", "cpu", "disk", "remote")
        },
        "hot_gpu_hit": round(sum(r["tier"] == "gpu" for r in hot) / max(1, len(hot)), 3),
        "reloads_after_eviction": sum(c["reloads_after_eviction"] for _, c in runs),
        "evictions": sum(c["evictions"] for _, c in runs),
        "hot_ttft_p50_ms": pct([r["ttft"] for r in hot], 0.5),
        "hot_ttft_p99_ms": pct([r["ttft"] for r in hot], 0.99),
        "hot_in_burst": len(in_window(records)) if window else None,
        "hot_ttft_p99_burst_ms": pct(in_window(records), 0.99) if window else None,
        "hot_ttft_p99_burst_per_seed_ms": [pct(in_window(recs), 0.99) for recs, _ in runs]
        if window
        else None,
        "all_ttft_p99_ms": pct([r["ttft"] for r in records], 0.99),
        # the shift workloads: the requests of the traffic that follows the seed scenario (or of its
        # control)
        "shifted_gpu_hit": round(sum(r["tier"] == "gpu" for r in shifted) / len(shifted), 3)
        if shifted
        else None,
        "shifted_ttft_p50_ms": pct([r["ttft"] for r in shifted], 0.5) if shifted else None,
        "shifted_ttft_p99_ms": pct([r["ttft"] for r in shifted], 0.99) if shifted else None,
        # what the tail is made of: the slowest hot requests of the burst window, with the tier each
        # found
        "slowest_hot_in_burst": sorted(
            (
                {
                    "arrival_s": round(r["arrival"], 3),
                    "adapter": r["adapter"],
                    "tier": r["tier"],
                    "ttft_ms": round(r["ttft"] * 1000, 1),
                }
                for r in records
                if r["group"] == "hot" and during_burst(r)
            ),
            key=lambda r: -r["ttft_ms"],
        )[:5],
    }


def run_once(
    model_dir: Path,
    tmp: Path,
    setup: str,
    policy: str,
    trace: list[tuple],
    names: list[str],
    paths: dict,
    digests: dict,
    base_url: str,
    adapter_bytes: int,
    prewarm: list[str],
    cpu_adapters: int = 8,
    device: str = "cpu",
) -> tuple:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            device=device,
            max_loras=4,
            max_lora_rank=64,
            kv_cache_memory_bytes=64 * 2**20,
            eviction_policy=policy,
            cpu_cache_bytes=cpu_adapters * adapter_bytes,
            disk_cache_dir=tmp / f"disk-{time.perf_counter_ns()}",
            disk_cache_bytes=6 * adapter_bytes,
            allowed_roots=(base_url,),
        )
    )
    try:
        refs = {}
        for name in names:
            key = AdapterKey(engine.base_model_digest, name, "1", digests[name])
            refs[name] = (
                AdapterRef(key, path=paths[name])
                if setup == "disk"
                else AdapterRef(key, storage_uri=f"{base_url}/{digests[name][7:]}")
            )
        for name in prewarm:
            engine.adapters.prewarm(refs[name], "gpu")
        engine.adapters.drain()
        records = replay(engine, trace, refs, engine.tokenizer.encode("<s>hello world<sep>"))
        counters = {
            "reloads_after_eviction": engine.adapters.ledger.reloads_after_eviction,
            "evictions": engine.adapters.ledger.num_evictions,
        }
    finally:
        engine.close()
    return records, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench/results/cache_policy.json")
    parser.add_argument(
        "--workloads", help="comma-separated subset, e.g. hot-burst,no-burst (default: all)"
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="runs of each workload, each with its own arrivals"
    )
    parser.add_argument(
        "--cpu-adapters",
        type=int,
        default=8,
        help=(
            "host memory, in adapters of the largest size (vLLM's max_cpu_loras defaults to the "
            "slots: 4)"
        ),
    )
    parser.add_argument("--device", default="cpu", help="the engine's device: cpu or cuda")
    parser.add_argument("--seconds", type=float, help="length of each trace (default 20; quick 6)")
    parser.add_argument(
        "--rate", type=float, default=4.0, help="hot requests per second in the seed scenario"
    )
    parser.add_argument(
        "--control-policies",
        default="lru,score",
        help="policies run on the controls (no-burst, burst-compute); the goals read only score's",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engine: one leaves the other core to the loads, as a GPU "
        "server's compute runs on its device while the host loads adapters",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=200)
    num_zipf = 40 if args.quick else 200
    seconds = args.seconds or (6.0 if args.quick else 20.0)
    seeds = range(1 if args.quick else args.seeds)
    workloads = {}
    for seed in seeds:
        burst = hot_burst(4, 20, seconds, args.rate, random.Random(seed))
        workloads.setdefault("hot-burst", []).append(burst)
        workloads.setdefault("no-burst", []).append([x for x in burst if x[2] == "hot"])
        # the control: the burst's requests at the same times, on the hot adapters (its compute,
        # none of its loads)
        workloads.setdefault("burst-compute", []).append(
            [
                (t, f"hot{int(name[4:]) % 4}" if group == "cold" else name, group)
                for t, name, group in burst
            ]
        )
        # a change of traffic: Zipf(0.9) over other adapters right after the seed scenario, on the
        # same engine, and the same Zipf requests on a fresh engine (the control)
        after = [
            (t, name, "shifted")
            for t, name, _ in zipf(
                num_zipf, 0.9, int(4.0 * seconds * 3), 4.0, random.Random(2000 + seed)
            )
        ]
        workloads.setdefault("shift", []).append(
            burst + [(seconds + 1.0 + t, name, g) for t, name, g in after]
        )
        workloads.setdefault("shift-control", []).append(after)
        rng = random.Random(1000 + seed)
        for alpha in (0.9,) if args.quick else (0.6, 0.9, 1.2):
            workloads.setdefault(f"zipf-{alpha}", []).append(
                zipf(num_zipf, alpha, 60 if args.quick else 240, 6.0, rng)
            )
    if args.workloads:
        workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model")
        cfg = ModelConfig.from_dir(model_dir)
        names = (
            [f"hot{i}" for i in range(4)]
            + [f"cold{i}" for i in range(20)]
            + [f"z{i}" for i in range(num_zipf)]
        )
        remote = ArtifactStore(tmp / "remote")
        paths, digests = {}, {}
        for i, name in enumerate(names):
            paths[name] = write_adapter(
                cfg, RANKS[i % len(RANKS)], torch.float32, tmp / "adapters" / name
            )
            digests[name] = remote.put(paths[name])
        adapter_bytes = max(remote.size(d) for d in digests.values())
        with shaped_store_process(remote.root) as base_url:
            for setup in ("disk", "remote"):
                for workload, traces in workloads.items():
                    seeded = workload in ("hot-burst", "no-burst", "burst-compute", "shift")
                    # no-burst: the same hot arrivals, measured over the same window
                    window = (seconds / 3, 2 * seconds / 3) if seeded else None
                    policies = (
                        args.control_policies.split(",")
                        if workload in CONTROLS
                        else ("lru", "score")
                    )
                    for policy in policies:
                        runs = [
                            run_once(
                                model_dir,
                                tmp,
                                setup,
                                policy,
                                trace,
                                names,
                                paths,
                                digests,
                                base_url,
                                adapter_bytes,
                                [f"hot{i}" for i in range(4)] if seeded else [],
                                args.cpu_adapters,
                                args.device,
                            )
                            for trace in traces
                        ]
                        row = {
                            "setup": setup,
                            "workload": workload,
                            "policy": policy,
                            "seeds": len(traces),
                            **summarize(runs, window),
                        }
                        rows.append(row)
                        console.log(row)
    table = Table(
        title="Cache policies in the real engine (4 slots; TTFT in ms; rows pool every seed)"
    )
    columns = [
        "setup",
        "workload",
        "policy",
        "requests",
        "errors",
        "hit_gpu",
        "hit_cpu",
        "hit_disk",
        "hit_remote",
        "hot_gpu_hit",
        "reloads_after_eviction",
        "hot_ttft_p50_ms",
        "hot_ttft_p99_ms",
        "hot_in_burst",
        "hot_ttft_p99_burst_ms",
        "hot_ttft_p99_burst_per_seed_ms",
        "shifted_ttft_p50_ms",
        "shifted_ttft_p99_ms",
    ]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row.get(c)) for c in columns))
    console.print(table)
    ratios = {}
    for setup in ("disk", "remote"):
        pick = {(r["workload"], r["policy"]): r for r in rows if r["setup"] == setup}
        if not {("hot-burst", "lru"), ("hot-burst", "score"), ("no-burst", "score")} <= pick.keys():
            continue
        lru, score = pick[("hot-burst", "lru")], pick[("hot-burst", "score")]
        calm = pick[("no-burst", "score")]
        ratios[setup] = {
            "burst_hot_p99_lru_over_score": round(
                lru["hot_ttft_p99_burst_ms"] / score["hot_ttft_p99_burst_ms"], 2
            ),
            "burst_hot_p99_score_over_no_burst": round(
                score["hot_ttft_p99_burst_ms"] / calm["hot_ttft_p99_burst_ms"], 2
            ),
        }
    console.print(ratios)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    Path(args.json).write_text(
        json.dumps(
            {
                "rows": rows,
                "goals": ratios,
                "threads": args.threads,
                "device": args.device,
                "gpu": gpu,
                "seconds": seconds,
                "rate": args.rate,
                "cpu_adapters": args.cpu_adapters,
                "remote": {
                    "latency_s": ShapedHandler.latency_s,
                    "bytes_per_s": ShapedHandler.bytes_per_s,
                },
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
