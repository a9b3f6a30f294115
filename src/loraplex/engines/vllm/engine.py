"""`serve --engine vllm`: vLLM's AsyncLLM in this process (its engine core in a process of its own),
vLLM's OpenAI serving layer for the request surface, and loraplex's residency deciding which
adapters vLLM holds."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.artifacts import AllowList
from loraplex.engines.contract import Engine, OpenAIServing, RequestLayers, RequestUsage
from loraplex.engines.errors import EngineUnavailable, InvalidRequest, RequestRefused
from loraplex.engines.rank_skew import RankSkew, rank_bucket
from loraplex.engines.vllm.patches import handled
from loraplex.engines.vllm.slots import HOST_BYTES_UNBOUNDED, EngineRuntime, vllm_residency
from loraplex.engines.vllm.support import ServabilityCheck
from loraplex.model_config import base_model_digest
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterRef
from loraplex.residency.policy import make_policy
from loraplex.settings.fields import same_named
from loraplex.settings.serve import DEFAULTS as D
from loraplex.settings.serve import ServeSettings
from loraplex.settings.serve_values import VLLM_HOST_CACHE_PER_SLOT
from loraplex.spawn import without_main_module

if TYPE_CHECKING:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    from loraplex.engines.contract import L

log = logging.getLogger(__name__)
_OUR_ID = re.compile(r"[0-9a-f]{32}")
ZERO_ADAPTER_NAME = "loraplex-base"
ZERO_ADAPTER_ID = 1 << 62  # outside lora_int_id's 62 bits


class VllmStartError(Exception):
    """vLLM could not start (missing package, bad option, no memory); the message is the line
    printed."""


@dataclass(frozen=True)
class VllmConfig:
    """The fields `serve` sets have their names, defaults and help in `ServeSettings`."""

    model_dir: Path
    served_model_name: str
    data_dir: Path
    max_loras: int = D.max_loras
    max_cpu_loras: int | None = D.max_cpu_loras
    """Adapters in vLLM's host cache (default: 4 x max_loras); loraplex chooses which."""
    max_lora_rank: int = D.max_lora_rank
    dtype: str = D.dtype
    max_model_len: int | None = D.max_model_len
    eviction_policy: str = D.eviction_policy
    disk_cache_bytes: int = D.disk_cache_bytes
    allowed_roots: tuple[str, ...] = ()
    base_as_zero_adapter: str = D.base_as_zero_adapter
    """Carry base-model requests as an all-zero adapter: on, off, or auto (on for vLLM's CPU
    backend when loraplex's plugin does not fix its mixed base/LoRA batches, which give base rows
    another row's LoRA: `patches.py`)."""
    vllm_args: tuple[str, ...] = ()
    """vLLM engine options, as `vllm serve` takes them (--tensor-parallel-size 2, ...)."""
    tenant_gpu_share: float = D.tenant_gpu_share

    @property
    def host_cache_size(self) -> int:
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return VLLM_HOST_CACHE_PER_SLOT * self.max_loras

    @classmethod
    def from_settings(
        cls, s: ServeSettings, served_model_name: str, store_root: Path | None
    ) -> VllmConfig:
        """`store_root`: the registry's artifact store, a trusted source of artifacts. The
        sizing settings vLLM shares keep their meaning; the others pass through."""
        roots = (*s.allowed_roots, str(store_root.resolve())) if store_root else s.allowed_roots
        values = same_named(cls, s)
        values.update(served_model_name=served_model_name, allowed_roots=tuple(roots))
        return cls(**values, model_dir=s.model, vllm_args=vllm_args(s))


def vllm_args(s: ServeSettings) -> tuple[str, ...]:
    """The settings vLLM's engine takes, as `vllm serve` spells them, then `--vllm-arg`'s
    (`--vllm-arg=--name=value`: two)."""
    out = [
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--max-num-batched-tokens",
        str(s.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(s.gpu_memory_utilization),
        "--seed",
        str(s.seed),
    ]
    if s.kv_cache_memory_bytes is not None:
        out += ["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)]
    if s.tensor_parallel_size is not None:
        out += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.enable_prefix_caching is not None:
        out.append(
            "--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    for arg in s.vllm_arg:
        out += arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]
    return tuple(out)


@dataclass
class _Figures:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0  # tokens looked up in the prefix cache, since the start
    prefix_hits: int = 0  # of those, found


class VllmEngine(Engine, OpenAIServing):
    """vLLM's engine and its OpenAI serving layer, which answers the requests itself: the server
    runs them through `request_layer`'s `over_serving`."""

    def __init__(self, config: VllmConfig):
        self.config = config
        self.base_model_digest = base_model_digest(config.model_dir)
        self.servable = ServabilityCheck(config.model_dir, config.max_lora_rank)
        self.figures = _Figures()
        self.tracked: dict[str, RequestUsage] = {}
        """One client request's generations inside vLLM (n > 1 is several), by our request id."""
        self.rank_skew = RankSkew()
        self.lora_ranks: dict[str, int] = {}
        """vLLM's adapter names -> their rank (0: the zero adapter), read at their first request."""
        self.args, vllm_config = self._vllm_config()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.zero_adapter = self._zero_adapter_wanted(vllm_config)
        self.llm = self._start(vllm_config)
        allowed = AllowList.parse(list(config.allowed_roots))
        disk = DiskTier(config.data_dir / "cache", config.disk_cache_bytes, allowed)
        runtime = EngineRuntime(
            self.llm,
            config.data_dir / "vllm-adapters",
            kept_bytes=config.disk_cache_bytes,  # staged copies kept beyond vLLM's host cache
        )
        self.adapters = vllm_residency(
            runtime,
            max_loras=config.max_loras,
            max_cpu_loras=config.host_cache_size,
            disk=disk,
            reserved_slots=1 if self.zero_adapter else 0,
            scheduler_counts_pins=handled("pinned_slots"),
            policy=make_policy(config.eviction_policy),
            budgets=TenantBudgets(
                config.max_loras, HOST_BYTES_UNBOUNDED, gpu_share=config.tenant_gpu_share
            ),
        )
        self.serving_completion: Any = None
        self.serving_chat: Any = None
        self.models: OpenAIServingModels | None = None  # vLLM's serving layer, made by `start`

    # -- start and stop ----------------------------------------------------------------------------
    def _vllm_config(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        c = self.config
        extra = 1 if _may_carry_zero_adapter(c.base_as_zero_adapter) else 0  # its slot and copy
        argv = [
            "--model",
            str(c.model_dir),
            "--served-model-name",
            c.served_model_name,
            "--enable-lora",
            "--max-loras",
            str(c.max_loras + extra),
            "--max-cpu-loras",
            str(c.host_cache_size + extra),
            "--max-lora-rank",
            str(c.max_lora_rank),
            "--dtype",
            c.dtype,
            "--generation-config",
            "vllm",
        ]
        if c.max_model_len is not None:
            argv += ["--max-model-len", str(c.max_model_len)]
        parser = make_arg_parser(
            FlexibleArgumentParser(prog="loraplex serve --engine vllm", exit_on_error=False)
        )
        try:
            args = parser.parse_args([*argv, *c.vllm_args])
            engine_args = AsyncEngineArgs.from_cli_args(args)
            return args, engine_args.create_engine_config()
        except SystemExit:
            raise VllmStartError(
                f"--vllm-arg: vLLM refused the options {' '.join(c.vllm_args)}"
            ) from None
        except (
            Exception
        ) as exc:  # vLLM raises many kinds for a bad option or model: one line names it
            raise VllmStartError(f"vLLM cannot serve {c.model_dir}: {_first_line(exc)}") from None

    def _zero_adapter_wanted(self, vllm_config) -> bool:
        mode = self.config.base_as_zero_adapter
        on_cpu = vllm_config.device_config.device_type == "cpu"
        return _may_carry_zero_adapter(mode) and (mode == "on" or on_cpu)

    def _start(self, vllm_config):
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = self

        class LoraplexAsyncLLM(AsyncLLM):
            """AsyncLLM whose generate records each request's first token and counts, and carries
            base requests as the zero adapter when that is on."""

            async def generate(
                self, prompt, sampling_params, request_id, *args, lora_request=None, **kwargs
            ):
                if lora_request is None and engine.zero_adapter:
                    lora_request = engine.zero_lora
                rank = engine.rank_of(lora_request)
                match = _OUR_ID.search(request_id)
                tracked = engine.tracked.get(match[0]) if match else None
                cumulative = sampling_params.output_kind == RequestOutputKind.CUMULATIVE
                async for out in super().generate(
                    prompt, sampling_params, request_id, *args, lora_request=lora_request, **kwargs
                ):
                    if tracked is not None:
                        _track(tracked, request_id, out, cumulative)
                    if out.finished:
                        _observe_tpot(engine.rank_skew, rank, out.metrics)
                    yield out

        try:
            with without_main_module():
                llm = LoraplexAsyncLLM.from_vllm_config(
                    vllm_config=vllm_config,
                    disable_log_stats=False,
                    stat_loggers=[self._stat_logger()],
                )
        except Exception as exc:
            raise VllmStartError(f"vLLM's engine did not start: {_first_line(exc)}") from None
        _drop_prometheus_logger(llm)
        return llm

    def _stat_logger(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        figures, engine = self.figures, self

        class Figures(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.running: set[str] = set()  # the adapters running after the last step

            def record(
                self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
            ):
                if scheduler_stats is not None:
                    figures.num_running = scheduler_stats.num_running_reqs
                    figures.num_waiting = scheduler_stats.num_waiting_reqs
                    figures.kv_cache_usage = scheduler_stats.kv_cache_usage
                    prefix = scheduler_stats.prefix_cache_stats
                    figures.prefix_queries += prefix.queries
                    figures.prefix_hits += prefix.hits
                    running = {
                        n for n, count in scheduler_stats.running_lora_adapters.items() if count
                    }
                    # the step ran those that ran before it and those it admitted (some of which
                    # it may have finished)
                    in_step, self.running = self.running | running, running
                    if iteration_stats is not None and iteration_stats.inter_token_latencies_iter:
                        largest = max((engine.lora_ranks.get(n, 0) for n in in_step), default=0)
                        # a decode's inter-token latency is the engine core's step time; a request
                        # that sat out steps (preempted) has a longer one
                        step_s = min(iteration_stats.inter_token_latencies_iter)
                        engine.rank_skew.step.observe(rank_bucket(largest), step_s)

            def log_engine_initialized(self):
                pass

        return Figures

    async def start(self) -> None:
        """On the server's loop: the serving layer (vLLM's OpenAI request handling), the zero
        adapter."""
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        self.adapters.backend.start(asyncio.get_running_loop())
        state = State()
        await init_app_state(self.llm, state, self.args, await self.llm.get_supported_tasks())
        self.serving_completion, self.serving_chat = (
            state.openai_serving_completion,
            state.openai_serving_chat,
        )
        self.models = state.openai_serving_models
        if self.zero_adapter:
            from vllm.lora.request import LoRARequest

            path = write_zero_adapter(
                self.config.model_dir, self.config.data_dir / "vllm-zero-adapter"
            )
            self.zero_lora = LoRARequest(ZERO_ADAPTER_NAME, ZERO_ADAPTER_ID, str(path))
            await self.llm.add_lora(self.zero_lora)
            await self.llm.pin_lora(ZERO_ADAPTER_ID)

    def stop(self) -> None:
        self.adapters.close()
        self.llm.shutdown()

    @property
    def is_alive(self) -> bool:
        return not self.llm.errored

    @property
    def model_dir(self) -> Path:
        return self.config.model_dir

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    # -- the request path --------------------------------------------------------------------------
    def request_layer(self, layers: RequestLayers[L]) -> L:
        return layers.over_serving(self)

    async def acquire(self, ref: AdapterRef | None) -> Any:
        """The adapter's LoRARequest once vLLM holds it in a slot (loraplex's residency decides
        which adapters vLLM holds)."""
        if ref is None:
            return None
        if ref.path is not None:  # what vLLM cannot serve never reaches it, nor takes a slot
            refusal = self.servable.refusal(ref.key.adapter_digest, ref.path)
            if refusal is not None:
                raise RequestRefused(
                    400, f"{ref.key.name}: {refusal}", "adapter_not_servable", "model"
                )
        self.adapters.record_request(ref)
        return await self.adapters.acquire(ref)

    def release(self, ref: AdapterRef | None, held: Any) -> None:
        if ref is not None and held is not None:
            self.adapters.release(ref.key, ref.tenant)

    def parse(self, body: bytes, chat: bool) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return (ChatCompletionRequest if chat else CompletionRequest).model_validate_json(body)

    def track(self, request_id: str) -> None:
        self.tracked[request_id] = RequestUsage()

    def untrack(self, request_id: str) -> RequestUsage | None:
        return self.tracked.pop(request_id, None)

    async def answer(self, request: Any, chat: bool, model: str, held: Any) -> Any:
        """vLLM's answer as a dict, or its event stream; its refusals as the engines' errors."""
        if held is not None:
            self.serve_as(model, held)
        request.model = model
        if chat:
            assert self.serving_chat is not None  # made by `start`
            call = self.serving_chat.create_chat_completion(request, None)
        else:
            assert self.serving_completion is not None  # made by `start`
            call = self.serving_completion.create_completion(request, None)
        return await _answer(call)

    def serve_as(self, name: str, lora_request) -> None:
        """Make `name` a model of vLLM's serving layer, meaning exactly this key's request."""
        assert self.models is not None  # made by `start`
        self.models.lora_requests[name] = lora_request

    async def complete_text(self, prompt: str, ref, max_tokens: int = 32) -> str:
        """Greedy completion of `prompt` with the adapter (release checks)."""
        from vllm import SamplingParams

        lora = await self.adapters.acquire(ref)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            text = ""
            async for out in self.llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
                text = out.outputs[0].text
            return text
        finally:
            self.adapters.release(ref.key, ref.tenant)

    async def score_tokens(self, ids: list[int], ref) -> list[float]:
        from vllm import SamplingParams

        lora = await self.adapters.acquire(ref) if ref is not None else None
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            prompt = {"prompt_token_ids": list(ids)}
            final = None
            async for out in self.llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
                final = out
        finally:
            if ref is not None:
                self.adapters.release(ref.key, ref.tenant)
        assert final is not None and final.prompt_logprobs is not None
        return [entry[t].logprob for t, entry in zip(ids[1:], final.prompt_logprobs[1:])]

    def rank_of(self, lora_request) -> int:
        """The adapter's rank, from the adapter_config.json vLLM loads it with (0: none, or the
        zero adapter, which is the base model)."""
        if lora_request is None or lora_request.lora_name == ZERO_ADAPTER_NAME:
            return 0
        name = lora_request.lora_name
        if name not in self.lora_ranks:
            config = Path(lora_request.lora_path) / "adapter_config.json"
            try:
                self.lora_ranks[name] = int(json.loads(config.read_text()).get("r") or 0)
            except (OSError, ValueError):  # vLLM's load reports the file's fault
                return 0
        return self.lora_ranks[name]

    def live_figures(self) -> dict:
        cache = self.adapters.state()
        idle = not self.tracked  # the stat logger reports at steps: none come once vLLM is idle
        waiting = {
            k for k, e in list(self.adapters.entries.items()) if e.refcount and not e.in_vllm
        }
        return {
            "cache": cache,
            "num_running": 0 if idle else self.figures.num_running,
            "num_waiting": 0 if idle else self.figures.num_waiting,
            "active_tokens": sum(
                t.prompt_tokens + sum(t.completion_tokens.values())
                for t in list(self.tracked.values())
            ),
            "kv_cache_usage": 0.0 if idle else self.figures.kv_cache_usage,
            "prefix_cache": {
                "queries": self.figures.prefix_queries,
                "hits": self.figures.prefix_hits,
            },
            "waiting_keys": waiting,
            "max_loras": self.config.max_loras,
            "max_lora_rank": self.config.max_lora_rank,
            "rank_skew": self.rank_skew.snapshot(),
        }


def _may_carry_zero_adapter(mode: str) -> bool:
    """Whether `--base-as-zero-adapter MODE` may carry base requests as the zero adapter (and so
    takes a slot and a host cache place of vLLM's beyond `--max-loras`): on, or auto on the CPU
    backend where its mixed batches are not fixed (by vLLM or `patches.py`). GPUs never need it."""
    from vllm.platforms import current_platform

    if mode == "on":
        return True
    return mode == "auto" and current_platform.is_cpu() and not handled("no_lora_rows")


def _drop_prometheus_logger(llm) -> None:
    """vLLM's Prometheus logger writes a registry that nothing here serves (loraplex's /metrics has
    its own, the `vllm:*` gauges included), at the cost of event-loop time at every step."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    manager = llm.logger_manager
    if manager is not None:
        manager.stat_loggers = [
            s for s in manager.stat_loggers if not isinstance(s, PrometheusStatLogger)
        ]


def _observe_tpot(rank_skew: RankSkew, rank: int, stats) -> None:
    """A finished request's time per output token from vLLM's own figures (engine-core timestamps
    of its first and last token), as vLLM's `mean_time_per_output_token` is."""
    if stats is not None and stats.num_generation_tokens > 1:
        decode_s = stats.last_token_ts - stats.first_token_ts
        rank_skew.tpot.observe(rank_bucket(rank), decode_s / (stats.num_generation_tokens - 1))


async def _answer(call) -> dict | AsyncIterator[str]:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        result = await call
    except (VLLMValidationError, ValueError, TypeError, NotImplementedError) as exc:
        raise InvalidRequest(getattr(exc, "parameter", None), str(exc)) from None
    except (EngineDeadError, EngineGenerateError) as exc:
        raise EngineUnavailable(f"the vLLM engine failed: {exc}") from None
    if isinstance(result, ErrorResponse):
        error = result.error
        raise RequestRefused(error.code, error.message, _code(error.type), error.param)
    if hasattr(result, "model_dump"):
        return result.model_dump(mode="json", exclude_none=False)
    return result


def _code(error_type: str) -> str:
    return {"BadRequestError": "invalid_value", "NotFoundError": "model_not_found"}.get(
        error_type, error_type
    )


def _track(tracked: RequestUsage, request_id: str, out, cumulative: bool) -> None:
    now = time.monotonic()
    tracked.prompt_tokens = max(tracked.prompt_tokens, len(out.prompt_token_ids or ()))
    produced = sum(len(o.token_ids) for o in out.outputs)
    if produced:
        tracked.first_token_at = tracked.first_token_at or now
        tracked.last_token_at = now
    before = 0 if cumulative else tracked.completion_tokens.get(request_id, 0)
    tracked.completion_tokens[request_id] = before + produced


def write_zero_adapter(model_dir: Path, out: Path) -> Path:
    """A rank-8 LoRA on every layer's o_proj (which every base served has, fused or not) with
    all-zero weights: it adds exactly nothing."""
    import torch
    from safetensors.torch import save_file

    from loraplex.model_config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    out.mkdir(parents=True, exist_ok=True)
    rank, (d_in, d_out) = 8, cfg.linear_shape("o_proj")
    tensors = {}
    for layer in range(cfg.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, d_in)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(d_out, rank)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": rank,
                "target_modules": ["o_proj"],
                "bias": "none",
                "base_model_name_or_path": str(model_dir),
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def cpu_env_defaults() -> None:
    """vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); 1 unless the
    operator set it."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
