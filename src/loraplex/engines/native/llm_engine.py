"""The engine: one base model, many adapters, continuous batching. `step()` is the whole serving
loop."""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loraplex.artifacts import digest_and_pieces
from loraplex.engines.native.async_engine import AsyncEngine
from loraplex.engines.native.block_manager import BlockManager, salt_of_key
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.front import NativeFront
from loraplex.engines.native.kv_budget import KVBudget, kv_budget, num_blocks
from loraplex.engines.native.loader import load_model, resolve_device, resolve_dtype
from loraplex.engines.native.lora import LoRASlotPool, pack_adapter
from loraplex.engines.native.runner import ModelRunner
from loraplex.engines.native.sampler import Sampled, Sampler
from loraplex.engines.native.scheduler import ScheduledBatch, Scheduler
from loraplex.engines.native.sequence import (
    InvalidRequest,
    NonFiniteLogits,
    RequestOutput,
    SamplingParams,
    Sequence,
    Status,
)
from loraplex.engines.native.slots import residency_for
from loraplex.engines.native.structured import Grammars
from loraplex.engines.native.tokenizer import Tokenizer
from loraplex.engines.rank_skew import RankSkew, rank_bucket
from loraplex.lora_format import (
    WEIGHTS_FILE,
    AdapterRejected,
    AdapterSpec,
    adapter_from_files,
    read_adapter,
)
from loraplex.model_config import ModelConfig, base_model_digest
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.key import AdapterKey, AdapterRef

if TYPE_CHECKING:
    pass


class LLMEngine(NativeFront):
    """The serving loop is `step()`; `start` runs it on a thread of its own (`AsyncEngine`), whose
    `generate` the server's requests go through."""

    def __init__(self, config: EngineConfig, policy=None):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer(config.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.device = resolve_device(config.device)
        self.max_model_len = config.max_model_len or min(
            self.model_config.max_position_embeddings, 4096
        )
        # the operator's figure: checked before loading
        if config.kv_cache_memory_bytes is not None:
            self._kv_blocks(self._kv_budget())
        self.model = load_model(config.model_dir, self.dtype, self.device)
        self.base_model_digest = base_model_digest(config.model_dir)
        self.eos_ids = tuple(self.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.pool = LoRASlotPool(
            self.model_config, config.max_loras, config.max_lora_rank, self.dtype, self.device
        )
        self.model.attach_lora(self.pool)
        self.adapters = residency_for(config, self.pool, self._pack_adapter, policy)
        # After the weights and the slots: on CUDA the budget is what they leave of the device.
        self.kv_budget = self._kv_budget()
        self.blocks = BlockManager(
            self._kv_blocks(self.kv_budget), config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks, self.adapters)
        self.runner = ModelRunner(self.model, self.pool, self.blocks, self.dtype, self.device)
        # Requests that give no seed of their own draw from the engine's generator (--seed).
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.model_config.vocab_size, self.eos_ids, self.device, generator)
        self.rank_skew = RankSkew()
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        self.requests: dict[str, list[Sequence]] = {}
        """The live sequences of each request id (several with n > 1 or best_of)."""
        self._inbox: list[Sequence | str | AdapterKey] = []
        """Sequences to add, ids of requests to abort and adapters forgotten (their prefix-cache
        blocks go), in arrival order."""
        self._inbox_lock = threading.Lock()
        self.adapters.on_forget = self._forgotten
        self._stepper: AsyncEngine | None = None
        """The step loop's thread, once started (`start`)."""
        self._failed: list[RequestOutput] = []
        self.empty_steps = 0
        """Steps that found nothing to run (requests waiting that none may join yet)."""
        # What exists now (the model, the libraries) lives as long as the engine. Out of the
        # collector's view, a full collection while serving scans only what serving allocated: with
        # it in view, each took 0.2-0.4 s on the step thread (bench/cache_policy.py, during the seed
        # scenario's burst of loads).
        gc.collect()
        gc.freeze()

    def _kv_budget(self) -> KVBudget:
        config, model, length = self.config, self.model_config, self.max_model_len
        return kv_budget(config, model, self.dtype, self.device, length)

    def _kv_blocks(self, budget: KVBudget) -> int:
        block_size = self.config.block_size
        return num_blocks(budget, self.model_config, self.dtype, block_size, self.max_model_len)

    # -- adapters --------------------------------------------------------------------------------
    def validate_adapter(self, path: str | Path) -> AdapterSpec:
        """Check a PEFT directory against the base model; raises AdapterRejected naming the
        field."""
        return read_adapter(path, self.model_config, self.config.max_lora_rank)

    def adapter_ref(
        self,
        name: str,
        path: str | Path,
        revision: str = "local",
        digest: str | None = None,
        **kwargs,
    ) -> AdapterRef:
        """A reference for a local adapter directory (validated now, so a bad one fails here)."""
        spec = self.validate_adapter(path)
        if digest is None:
            # hashed here, as a registry does at registration: the pieces come from the same read
            digest, kwargs["pieces"] = digest_and_pieces(Path(path))
        key = AdapterKey(self.base_model_digest, name, revision, digest)
        assert spec.path is not None  # read from a directory
        return AdapterRef(key, Path(spec.path), **kwargs)

    def _pack_adapter(self, files: dict[str, memoryview], hashed: Callable[[str, int], None]):
        """Cache worker thread, while the digest check runs: validate the bytes again (this base
        model, this max rank) and pack them for a slot; the cache keeps the result only if the
        digest matches."""
        try:
            spec = adapter_from_files(files, self.model_config, self.config.max_lora_rank)
        except AdapterRejected as exc:
            raise AdapterUnavailable(
                f"adapter files are not servable: {exc}",
                f"adapter files are not servable on this model ({exc.field})",
            ) from exc
        return pack_adapter(
            spec,
            files[WEIGHTS_FILE],
            self.dtype,
            pin=self.device.type == "cuda",
            hashed=lambda end: hashed(WEIGHTS_FILE, end),
        )

    # -- requests (any thread) -------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        request_id: str | None = None,
        counted: bool = True,
        matcher=None,
    ) -> str:
        """`counted`: reported as a cache hit or miss (a client request of several prompts reports
        its first). `matcher`: the grammar's matcher, if the caller compiled it already."""
        if not prompt_ids:
            raise InvalidRequest("prompt", "prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}",
            )
        if max(prompt_ids) >= self.model_config.vocab_size or min(prompt_ids) < 0:
            raise InvalidRequest(
                "prompt", f"token ids must be in [0, {self.model_config.vocab_size})"
            )
        self._check_group_fits(len(prompt_ids), params)
        seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, adapter)
        seq.num_forks = params.num_seqs - 1
        seq.detokenizer = self.tokenizer.output_decoder(seq.prompt_ids)
        # a schema the library refuses fails here, before the request runs
        if params.structured is not None:
            seq.matcher = matcher or self.grammars.matcher(params.structured)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq.cache_tier = self.adapters.record_request(adapter, counted) if adapter else "gpu"
        with self._inbox_lock:
            self._inbox.append(seq)
        return seq.request_id

    def _check_group_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The prompt's sequences (n, best_of) must fit the running batch and the KV cache
        together."""
        name, count = ("best_of", params.best_of) if params.best_of else ("n", params.n)
        if count > self.config.max_num_seqs:
            raise InvalidRequest(
                name, f"{name}={count} is more than max_num_seqs {self.config.max_num_seqs}"
            )
        needed = self.blocks.blocks_for_group(num_prompt_tokens, count)
        if needed > self.blocks.num_blocks:
            raise InvalidRequest(
                name,
                f"{name}={count} sequences of a {num_prompt_tokens}-token prompt need "
                f"{needed} KV blocks; the KV cache has {self.blocks.num_blocks}",
            )

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append(request_id)

    def live_figures(self) -> dict:
        """What /admin/state, the metrics and gateways read: residency, queue and KV figures."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        return {
            "cache": self.adapters.state(),
            "num_running": len(running),
            "num_waiting": len(waiting),
            "active_tokens": sum(len(s) for s in running),
            "kv_cache_usage": self.blocks.usage,
            "prefix_cache": self.blocks.prefix_figures(),
            "waiting_keys": {s.adapter.key for s in waiting if s.adapter is not None},
            "max_loras": self.config.max_loras,
            "max_lora_rank": self.config.max_lora_rank,
            "rank_skew": self.rank_skew.snapshot(),
            "empty_steps": self.empty_steps,
        }

    def has_work(self) -> bool:
        """Requests to run, or adapter loads to take in (a prewarm on an idle server finishes
        too)."""
        return bool(
            self._inbox or self.scheduler.has_work() or self._failed or self.adapters.loading
        )

    # -- the loop (one thread) -------------------------------------------------------------------
    def step(self, halve_bursts: bool = False) -> list[RequestOutput]:
        """One iteration: the outputs of every request it advanced or ended. `halve_bursts`: when
        nothing runs and more than half of max_num_seqs requests wait, half of them (rounded up)
        join this step and the rest the next, for a caller that works on this step's outputs while
        the next step runs (the engine process: its API server answers the first half of a burst
        meanwhile, where a whole burst would leave it idle during the step and the step loop idle
        while it answers)."""
        self._take_inbox()
        self._fail_unavailable(self.adapters.backend.poll())
        outputs, self._failed = self._failed, []
        try:
            batch = self.scheduler.schedule(self._half_burst() if halve_bursts else None)
            if not batch:
                self.empty_steps += 1
                return outputs
            started = time.perf_counter()
            largest = max((self._rank(s) for s in batch.seqs), default=0)  # before any ends
            step = self.runner.run(batch)
            for seq in batch.seqs:
                seq.num_computed += seq.num_scheduled
                if seq.num_hashed < len(seq.prompt_ids) // self.blocks.block_size:
                    self.blocks.cache_computed(seq)
            for part in step.prompt_logits:
                self._add_prompt_logprobs(part.seq, part.start, part.logits)
            seqs, logits = self._fork(step.seqs, step.logits)
            sampled = self.sampler(logits, seqs)
            self.sampler.record(seqs, sampled.tokens)
            for i, seq in enumerate(seqs):
                # NaN or infinite logits: this request fails, the batch goes on
                if sampled.tokens[i] is None:
                    self._end(seq, "error")
                    adapter = f" with adapter {seq.adapter.key}" if seq.adapter is not None else ""
                    outputs.append(
                        self._output(
                            seq,
                            [],
                            "",
                            [],
                            error=NonFiniteLogits(
                                f"the model gave non-finite logits (NaN or infinity){adapter}: the "
                                "request cannot be "
                                "completed"
                            ),
                        )
                    )
                    continue
                outputs.append(self._append(seq, sampled, i))
            self.rank_skew.step.observe(rank_bucket(largest), time.perf_counter() - started)
        except BaseException:
            # already taken off the books: fail_all delivers them
            self._failed = outputs + self._failed
            raise
        return outputs

    def _fork(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The further sequences of each newly prefilled prompt (n, best_of): they share its KV
        blocks and start from its logits."""
        rows, copies = list(range(len(seqs))), []
        for i, parent in enumerate(list(seqs)):
            for index in range(1, parent.num_forks + 1):
                child = self._child(parent, index)
                pair = self.scheduler.fork(parent, child)
                if pair is not None:
                    copies.append(pair)
                seqs.append(child)
                rows.append(i)
            parent.num_forks = 0
        if copies:
            self.runner.copy_blocks(copies)
        if len(rows) == len(logits):
            return seqs, logits
        return seqs, logits[torch.tensor(rows, device=logits.device)]

    def _child(self, parent: Sequence, index: int) -> Sequence:
        p = parent.params
        child = Sequence(
            parent.request_id,
            parent.prompt_ids,
            p,
            parent.adapter,
            parent.arrival,
            index=index,
            prompt_logprobs=parent.prompt_logprobs,
            cache_tier=parent.cache_tier,
        )
        child.detokenizer = self.tokenizer.output_decoder(child.prompt_ids)
        if parent.matcher is not None:
            child.matcher = parent.matcher.fork()
        if p.seed is not None:  # a seed of its own, as vLLM's children
            seed = (p.seed + index) % 2**64
            child.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests[parent.request_id].append(child)
        return child

    def _add_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens a prefill chunk predicts, and the most likely
        alternatives there (the first prompt token has none). A chunk computed again (after a
        preemption) replaces its entries."""
        # logits: [n, V], row j predicts prompt token start + 1 + j
        k = seq.params.prompt_logprobs
        lp = torch.log_softmax(logits, dim=-1)
        tokens = seq.prompt_ids[start + 1 : start + 1 + len(lp)]
        picked = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        top_v, top_t = lp.topk(k) if k else (lp[:, :0], lp[:, :0].long())
        entries: list[dict | None] = [
            {"token": token, "logprob": logprob, "top": list(zip(ts, vs))}
            for token, logprob, ts, vs in zip(tokens, picked, top_t.tolist(), top_v.tolist())
        ]
        seq.prompt_logprobs = (seq.prompt_logprobs or [None])[: start + 1] + entries

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.release(seq)
        live = self.requests.get(seq.request_id, [])
        if seq in live:
            live.remove(seq)
        if not live:
            self.requests.pop(seq.request_id, None)

    def _half_burst(self) -> int | None:
        """How many waiting requests may join a step under `halve_bursts` (None: all)."""
        waiting = len(self.scheduler.waiting)
        if self.scheduler.running or waiting <= self.config.max_num_seqs // 2:
            return None
        return -(-waiting // 2)

    def _forgotten(self, key: AdapterKey) -> None:
        """The residency forgot `key` (any thread): the step loop drops its cached prefixes."""
        with self._inbox_lock:
            self._inbox.append(key)

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Sequence):
                self.requests[item.request_id] = [item]
                self.scheduler.add(item)
            elif isinstance(item, AdapterKey):
                self.blocks.drop_prefixes(salt_of_key(item))
            else:
                for seq in list(self.requests.get(item, ())):
                    self._end(seq, "abort")

    def _fail_unavailable(self, failures: list[tuple[AdapterKey, BaseException]]) -> None:
        """A failed load fails only the requests waiting for that adapter, and not those that its
        resident copy can still serve (a prewarm reloading the host copy of an adapter in a slot,
        say)."""
        for key, error in failures:
            if (
                self.adapters.backend.tiers.slot_of(key) is not None
                or key in self.adapters.backend.cpu
            ):
                continue
            for seq in [
                s for s in self.scheduler.waiting if s.adapter is not None and s.adapter.key == key
            ]:
                self._end(seq, "error")
                self._failed.append(self._output(seq, [], "", [], error=error))

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """End every request with the error (after a failed step) so that no client waits
        forever."""
        self._take_inbox()
        outputs, self._failed = self._failed, []
        for seq in [s for live in self.requests.values() for s in live]:
            self.scheduler.finish(seq, "error")
            self.sampler.release(seq)
            outputs.append(self._output(seq, [], "", [], error=error))
        self.requests.clear()
        return outputs

    def _append(self, seq: Sequence, sampled: Sampled, i: int) -> RequestOutput:
        token, logprob = sampled.tokens[i], sampled.logprobs[i]
        assert token is not None  # `step` ends a row without a token before it gets here
        token_logprob = sampled.token_logprobs[i]
        seq.first_token_at = seq.first_token_at or time.monotonic()
        seq.output_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if token_logprob is not None:
            seq.cumulative_logprob += token_logprob
        reason = self._finish_reason(seq, token)
        if seq.matcher is not None and reason is None:
            seq.matcher.accept_token(token)
            if seq.matcher.is_terminated():
                reason = "stop"
        before = len(seq.text)
        assert seq.detokenizer is not None  # every generating sequence has one (`add_request`)
        text = seq.text + seq.detokenizer.step(token)
        if seq.params.stop and len(seq.output_ids) < seq.params.min_tokens:
            seq.stop_from = len(text)  # as vLLM: no stop string ends the output before min_tokens
        elif seq.params.stop:
            # A stop string may end in the new text: look from where one could start in it.
            starts = (max(seq.stop_from, before - len(s) + 1) for s in seq.params.stop)
            hits = [
                i
                for i in (text.find(s, start) for s, start in zip(seq.params.stop, starts))
                if i >= 0
            ]
            if hits:
                text, reason = text[: min(hits)], "stop"
        if reason is not None:
            if len(seq.output_ids) > 1:
                tpot = (time.monotonic() - seq.first_token_at) / (len(seq.output_ids) - 1)
                self.rank_skew.tpot.observe(rank_bucket(self._rank(seq)), tpot)
            self._end(seq, reason)
        seq.text = text
        # Hold back what could still become a stop string.
        hold = 0 if reason else max((len(s) - 1 for s in seq.params.stop), default=0)
        ready = len(text) - hold
        delta = text[seq.sent_chars : max(ready, seq.sent_chars)]
        seq.sent_chars += len(delta)
        new_ids = seq.output_ids[seq.sent_tokens :]
        new_logprobs = seq.output_logprobs[seq.sent_tokens :]
        seq.sent_tokens = len(seq.output_ids)
        return self._output(seq, new_ids, delta, new_logprobs)

    def _rank(self, seq: Sequence) -> int:
        """The rank of the adapter in the sequence's slot (0: the base model)."""
        return max(self.pool.module_ranks[seq.lora_slot]) if seq.lora_slot >= 0 else 0

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq, ids, text, logprobs, error=None) -> RequestOutput:
        wait = seq.admitted_at - seq.arrival if seq.admitted_at is not None else None
        first = seq.sent_tokens <= len(ids)  # the sequence's first output (or an error before any)
        return RequestOutput(
            seq.request_id,
            ids,
            text,
            logprobs,
            seq.status is Status.FINISHED,
            seq.finish_reason,
            len(seq.prompt_ids),
            len(seq.output_ids),
            error,
            index=seq.index,
            cumulative_logprob=seq.cumulative_logprob if seq.params.best_of else None,
            prompt_logprobs=seq.prompt_logprobs if first else None,
            cache_tier=seq.cache_tier,
            queue_wait_s=wait,
        )

    async def start(self) -> None:
        self._stepper = AsyncEngine(self)

    def stop(self) -> None:
        if self._stepper is not None:
            self._stepper.stop()  # closes the engine

    @property
    def is_alive(self) -> bool:
        return self._stepper is None or self._stepper.is_alive

    @property
    def generation(self) -> AsyncEngine:
        assert self._stepper is not None, "the engine has not started"
        return self._stepper

    # -- convenience -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        adapters: list[AdapterRef | None] | None = None,
    ) -> list[list[int]]:
        """Run requests to completion in one continuous batch; the output token ids per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters or [None] * len(prompts)
        ids = [self.add_request(p, sp, a) for p, sp, a in zip(prompts, params_list, adapters)]
        done: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_work():
            for out in self.step():
                if out.error is not None:
                    raise out.error
                done[out.request_id] += out.token_ids
            if not self.scheduler.running and self.adapters.loading:
                self._wait_for_a_load()
        return [done[i] for i in ids]

    def _wait_for_a_load(self) -> None:
        """Block until one of the cache's loads lands: nothing else moves while every request
        waits on one."""
        loads = list(self.adapters.loading.values())
        futures.wait(loads, return_when=futures.FIRST_COMPLETED)

    def score(
        self, prompts: list[list[int]], adapters: list[AdapterRef | None]
    ) -> list[torch.Tensor]:
        """Logits [len, vocab] of every prompt position (host tensors), all prompts in one
        mixed-adapter prefill."""
        seqs = [
            Sequence(f"score-{i}", list(p), SamplingParams(), a)
            for i, (p, a) in enumerate(zip(prompts, adapters))
        ]
        waiting = list(seqs)
        try:
            while waiting:
                # make every adapter resident first (a step of its own, like any waiting request)
                failures = self.adapters.backend.poll()
                self._fail_unavailable(failures)
                for key, error in failures:
                    # these sequences are in no queue: their load's failure is theirs
                    if any(seq.adapter is not None and seq.adapter.key == key for seq in waiting):
                        raise error
                for seq in list(waiting):
                    if seq.adapter is None or self.scheduler.take_adapter(seq, 0):
                        waiting.remove(seq)
                if waiting:
                    self._wait_for_a_load()
        except BaseException:
            for seq in seqs:
                if seq not in waiting:
                    self.scheduler.release(seq)  # the adapters already taken
            raise
        try:
            for seq in seqs:
                if not self.blocks.can_allocate(seq):
                    raise InvalidRequest("prompt", "prompts do not fit in the KV cache together")
                self.blocks.allocate(seq)
                # every prompt in one prefill, whatever max_num_batched_tokens
                seq.num_scheduled = len(seq)
            ordered, logits, _ = self.runner.run(ScheduledBatch(prefills=seqs), all_tokens=True)
        finally:
            for seq in seqs:
                self.scheduler.release(seq)
        logits = logits.cpu()
        spans = torch.tensor([len(s) for s in ordered]).cumsum(0).tolist()
        by_id = {s.request_id: logits[end - len(s) : end] for s, end in zip(ordered, spans)}
        return [by_id[s.request_id] for s in seqs]

    def close(self) -> None:
        self.adapters.close()
        gc.unfreeze()
