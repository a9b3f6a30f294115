"""On one GPU: plain vLLM against loraplex on vLLM (`serve --engine vllm`), the same model, adapters
and traces.

    python bench/vs_vllm_gpu.py OUT_DIR [--adapters 64] [--quick] [--json OUT.json]
        [--servers vllm,vllm+plugin,loraplex-vllm]

The model is built here with random weights in the shape of Llama-3-8B (32 layers, hidden 4096, 32
heads, 8 KV heads, bf16; nothing is downloaded), the adapters too (ranks 8 to 64 over the attention
projections). Both servers get the same limits (`--max-loras 8`, `--max-cpu-loras 32`,
`--max-lora-rank 64`); the workloads are the seed scenario (4 hot adapters, then a sweep of cold
ones), Zipf(0.9) and uniform over every adapter, base-model requests only, and a mixed trace (the
Zipf trace with every other request for the base model), replayed open-loop (TTFT, TPOT) and
closed-loop (throughput) by `loraplex bench serve`. Goals: loraplex's throughput at least 0.95x
plain vLLM's (base-only too), and a better hot-adapter p99 TTFT in the seed scenario. Before the
traces, a greedy request per adapter of a sample must give the same text on both servers, and so
must a base-model request sent beside them. The servers (`--servers`, in this order): `vllm`,
plain vLLM as released (VLLM_PLUGINS leaves loraplex's plugin out); `vllm+plugin`, the same vLLM
in the same environment with loraplex's plugin active (the comparison that prices loraplex's layer
alone); `loraplex-vllm`, loraplex on vLLM with the server's defaults, that plugin among them.
Ratios are loraplex's over each vLLM server run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from vs_vllm import Server, free_port  # noqa: E402

from loraplex.loadgen.traffic import LoadConfig, prepare_trace, run  # noqa: E402
from loraplex.sim.workload import WorkloadSpec, generate, hot_burst  # noqa: E402

VLLM_KINDS = ("vllm", "vllm+plugin")
"""Plain vLLM's server, without and with loraplex's plugin."""
LIMITS = {"max_loras": 8, "max_cpu_loras": 32, "max_lora_rank": 64}
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
MAX_PROMPT, MAX_OUTPUT = 256, 64


def build_model(out: Path) -> Path:
    """A random-weight Llama-3-8B-shaped model in bf16, written once (about 16 GB)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from tinymodels import save_tokenizer

    config = transformers.LlamaConfig(
        **SHAPE, torch_dtype="bfloat16", eos_token_id=1, bos_token_id=0
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


def build_adapters(model_dir: Path, out: Path, count: int) -> dict[str, Path]:
    """`count` PEFT adapters with random weights, ranks cycling 8, 16, 32, 64, on q/k/v/o of every
    layer."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    dims = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (hidden, hidden),
    }
    adapters = {}
    for i in range(count):
        name, rank = f"a{i:03d}", (8, 16, 32, 64)[i % 4]
        path = out / name
        adapters[name] = path
        if (path / "adapter_model.safetensors").exists():
            continue
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (d_in, d_out) in dims.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(rank, d_in, generator=gen) / d_in**0.5
                ).bfloat16()
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(d_out, rank, generator=gen) * 0.01
                ).bfloat16()
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": list(dims),
                    "bias": "none",
                    "task_type": "CAUSAL_LM",
                    "base_model_name_or_path": str(model_dir),
                }
            )
        )
    return adapters


def start(kind: str, model: Path, adapters: dict[str, Path], work: Path) -> Server:
    port = free_port()
    limits = [
        "--max-loras",
        str(LIMITS["max_loras"]),
        "--max-cpu-loras",
        str(LIMITS["max_cpu_loras"]),
        "--max-lora-rank",
        str(LIMITS["max_lora_rank"]),
    ]
    modules = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    if kind in VLLM_KINDS:
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--enable-lora",
            *limits,
            *modules,
        ]
    else:
        args = [
            sys.executable,
            "-m",
            "loraplex.cli",
            "serve",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--data-dir",
            str(work / "data"),
            "--vllm-arg=--max-model-len=2048",
            *limits,
            *modules,
        ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind == "vllm":
        env["VLLM_PLUGINS"] = ""  # vLLM as released
    else:
        env.pop("VLLM_PLUGINS", None)
    return Server(kind, args, env, work / f"{kind}.log", port, timeout_s=600)


def greedy(server: Server, names: list[str]) -> list[str]:
    """Greedy texts of `names` (the model's served name for the base model), sent side by side,
    so base and adapter rows share batches."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> str:
        body = {"model": name, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", timeout=300, json=body)
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def base_name(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def base_share(trace: list, every: int) -> list:
    """`trace` with every `every`-th request for the base model."""
    return [replace(r, adapter=None) if i % every == 0 else r for i, r in enumerate(trace)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="20 s traces instead of 60 s")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--servers", default="vllm,vllm+plugin,loraplex-vllm", help="run these, in this order"
    )
    args = parser.parse_args(argv)
    servers = [k for k in args.servers.split(",") if k]
    if "loraplex-vllm" not in servers or not set(servers) <= {*VLLM_KINDS, "loraplex-vllm"}:
        parser.error("--servers: loraplex-vllm and any of vllm, vllm+plugin")
    console = Console(width=200)
    start_s = time.monotonic()
    model = build_model(args.out / "llama3-8b-shape")
    adapters = build_adapters(model, args.out / "adapters", args.adapters)
    console.log(f"model and {len(adapters)} adapters ready in {time.monotonic() - start_s:.0f} s")
    duration = 20.0 if args.quick else 60.0
    names = sorted(adapters)
    seed = hot_burst(
        seed=0,
        num_hot=4,
        num_cold=len(names) - 4,
        rate_hot=8.0,
        burst_start_s=duration / 3,
        burst_s=duration / 6,
        duration_s=duration,
    )
    common = {"seed": 0, "duration_s": duration, "rate": 16.0, "num_adapters": len(names)}
    workloads = {
        "seed scenario": seed,
        "zipf 0.9": generate(WorkloadSpec(name="zipf", s=0.9, **common)),
        "uniform": generate(WorkloadSpec(name="uniform", popularity="uniform", **common)),
    }
    workloads = {
        k: prepare_trace(
            v, adapters=names, max_prompt_tokens=MAX_PROMPT, max_output_tokens=MAX_OUTPUT
        )
        for k, v in workloads.items()
    }
    workloads["base only"] = base_share(workloads["zipf 0.9"], 1)
    workloads["mixed"] = base_share(workloads["zipf 0.9"], 2)
    hot = {r.adapter for r in workloads["seed scenario"][:20]}
    results, answers = {}, {}
    for kind in servers:
        server = start(kind, model, adapters, args.out)
        try:
            base = base_name(server)
            answers[kind] = greedy(server, [base, *names[:4], base])
            rows = {}
            for name, trace in workloads.items():
                open_loop = run(LoadConfig(url=server.url), trace, per_request=True)
                closed = run(LoadConfig(url=server.url, clients=args.clients), trace)
                window = None
                if name == "seed scenario":
                    cold = [r.time for r in trace if r.adapter not in hot]
                    window = (min(cold), max(cold) + 1.0)
                lat = open_loop["latency"]["all"]
                rows[name] = {
                    "errors": open_loop["failed"] + closed["failed"],
                    "ttft_p50_ms": lat["ttft_ms"]["p50"],
                    "ttft_p99_ms": lat["ttft_ms"]["p99"],
                    "tpot_p50_ms": lat["tpot_ms"]["p50"],
                    "throughput_tok_s": closed["throughput"]["output_tokens_per_s"],
                    "throughput_req_s": closed["throughput"]["requests_per_s"],
                    "hot_ttft_p99_ms": _hot_p99(open_loop, trace, hot, window) if window else None,
                }
                console.log(kind, name, rows[name])
            results[kind] = rows
        finally:
            server.stop()
    ours = results["loraplex-vllm"]
    ratios = {
        f"ratios_loraplex_over_{kind}": {
            w: {
                c: round(ours[w][c] / results[kind][w][c], 3)
                for c in ("throughput_req_s", "throughput_tok_s", "ttft_p99_ms", "hot_ttft_p99_ms")
                if results[kind][w].get(c) and ours[w].get(c) is not None
            }
            for w in workloads
        }
        for kind in servers
        if kind in VLLM_KINDS
    }
    out = {
        "results": results,
        **ratios,
        "same_greedy_text": len({tuple(a) for a in answers.values()}) == 1,
        "limits": LIMITS,
        "adapters": len(names),
        "quick": args.quick,
    }
    console.print_json(json.dumps(out))
    path = args.json or args.out / "vs_vllm_gpu.json"
    path.write_text(json.dumps(out, indent=2))
    return 0


def _hot_p99(
    summary: dict, trace: list, hot: set[str], window: tuple[float, float]
) -> float | None:
    values = sorted(
        r["ttft_s"] * 1000
        for r in summary["records"]
        if r["ttft_s"] is not None
        and trace[r["index"]].adapter in hot
        and window[0] <= trace[r["index"]].time < window[1]
    )
    return round(values[min(len(values) - 1, int(0.99 * len(values)))], 1) if values else None


if __name__ == "__main__":
    sys.exit(main())
