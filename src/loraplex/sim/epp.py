"""An emulation of the llm-d EPP's (endpoint picker's) default scheduling profile over simulated
workers: `simulate --routing epp`.

Written from llm-d/llm-d-inference-scheduler at commit 520af47896e5f06e43d09aca281a1149187b0ffd
(the EPP's code, which lives there now under pkg/epp; "..." below is
pkg/epp/framework/plugins/scheduling):

- pkg/epp/config/loader/defaults.go, `loadDefaultConfig`: the default profile has no filter and
  three scorers, `queue-scorer` (weight 2), `kv-cache-utilization-scorer` (2) and
  `prefix-cache-scorer` (3); `ensureSchedulingLayer` adds a `max-score-picker`, and a scorer named
  without a weight gets `DefaultScorerWeight` (1).
- test/integration/epp/testdata/default-config.yaml: the same profile with
  `lora-affinity-scorer` as well, unweighted (so 1): the multi-LoRA form emulated here.
- pkg/epp/scheduling/scheduler_profile.go, `runScorerPlugins`: an endpoint's score is the sum of
  each scorer's score (clamped to [0, 1]) times its weight.
- .../scorer/queuedepth/queue.go: (max − q) / (max − min) of
  the candidates' waiting-queue sizes; 1 for all when they are equal.
- .../scorer/kvcacheutilization/kvcache_utilization.go: 1 − KV-cache usage.
- .../scorer/prefix/plugin.go: the share of the prompt's blocks the endpoint holds. These traces
  carry no shared prompts, so it is 0 everywhere and only its weight remains.
- .../scorer/loraaffinity/lora_affinity.go: 1 when the adapter is active there (a running
  request uses it), 0.8 when active + waiting adapters are fewer than its `max_lora`, 0.6 when a
  waiting request uses it, else 0.
- .../picker/maxscore/picker.go: the highest score, ties broken at random (shuffle, stable sort).
- pkg/epp/datalayer/runtime.go: the endpoints' metrics are scraped every 50 ms
  (`defaultRefreshInterval`); between scrapes the scores do not move.

What is not emulated: the flow-control layer (it holds requests only while the whole pool is
saturated) and the approximate prefix index (no prompt text here).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loraplex.sim.backend import _label
from loraplex.sim.config import SimConfig


@dataclass(frozen=True)
class EppProfile:
    queue: float = 2.0
    kv_cache_utilization: float = 2.0
    prefix_cache: float = 3.0
    lora_affinity: float = 1.0
    refresh_s: float = 0.05


@dataclass(frozen=True)
class EppView:
    """What the EPP scrapes from one vLLM server's metrics."""

    waiting: int
    """`vllm:num_requests_waiting`."""
    kv_usage: float
    """`vllm:kv_cache_usage_perc`, as a fraction."""
    active: frozenset[str]
    """`running_lora_adapters` of `vllm:lora_requests_info`."""
    waiting_models: frozenset[str]
    """`waiting_lora_adapters`."""
    max_active: int
    """`max_lora`."""


class EppPicker:
    def __init__(self, config: SimConfig, seed: int = 0, profile: EppProfile | None = None):
        self.profile = profile or EppProfile()
        self.max_active = config.gpu_slots
        # the KV cache holds a full batch of requests of 1,024 tokens (prompt and output)
        self.kv_tokens = config.max_num_seqs * 1024
        self.rng = random.Random(seed)
        self._views: list[EppView] = []
        self._at = -float("inf")

    def view(self, worker) -> EppView:
        return EppView(
            len(worker.waiting),
            min(1.0, worker.running_tokens / self.kv_tokens),
            frozenset(map(_label, worker.running_adapters)),
            frozenset(s.req.model for s in worker.waiting if s.req.model is not None),
            self.max_active,
        )

    def scores(self, views: list[EppView], model: str | None) -> list[float]:
        p = self.profile
        queues = [v.waiting for v in views]
        lo, hi = min(queues), max(queues)
        out = []
        for v in views:
            queue = 1.0 if hi == lo else (hi - v.waiting) / (hi - lo)
            kv = 1.0 - v.kv_usage
            out.append(
                p.queue * queue + p.kv_cache_utilization * kv + p.lora_affinity * lora(v, model)
            )
        return out

    def pick(self, sim, seq) -> int:
        if sim.now - self._at >= self.profile.refresh_s:
            self._views = [self.view(w) for w in sim.workers]
            self._at = sim.now
        scores = self.scores(self._views, seq.req.model)
        best = max(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == best])


def lora(v: EppView, model: str | None) -> float:
    """The lora-affinity scorer's score (a base-model request: the adapter is nowhere)."""
    if model is not None and model in v.active:
        return 1.0
    if len(v.active) + len(v.waiting_models) < v.max_active:
        return 0.8
    if model is not None and model in v.waiting_models:
        return 0.6
    return 0.0
