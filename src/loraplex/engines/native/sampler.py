"""Sampling over one step's last-token logits: every parameter mix in one batch of tensor ops.

The order is vLLM's: grammar mask, logit bias, min_tokens, penalties; then greedy rows take the
argmax, and the others are scaled by temperature, cut by min_p, top-k and top-p (only the rows that
have them are sorted), and drawn by inverting their cumulative sums at one uniform number per row (a
seeded row's from its own generator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engines.native.sequence import Sequence
from loraplex.engines.native.structured import grammar_mask

NEG_INF = float("-inf")


@dataclass
class Sampled:
    """One step's draw: per sequence, the token (None: the row could not be sampled), its logprob
    entry when asked, and the token's logprob under the model (None when nobody asked)."""

    tokens: list[int | None]
    logprobs: list[dict | None]
    token_logprobs: list[float | None]


class PenaltyRows:
    """Per sequence that has penalties, a persistent row of output token counts and of tokens seen
    (prompt and output): a step gathers its rows and adds the sampled tokens, instead of rebuilding
    them from token lists."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.rows: dict[tuple[str, int], int] = {}  # (request id, index) -> row
        self.free_rows: list[int] = []

    def row_of(self, seq: Sequence) -> int:
        row = self.rows.get(_key(seq))
        if row is None:
            row = self._new_row()
            self.rows[_key(seq)] = row
            self.counts[row] = 0
            self.seen[row] = False
            if seq.output_ids:  # a fork or a recompute that had sampled before
                out = torch.tensor(seq.output_ids, device=self.device)
                self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            self.seen[row, torch.tensor(seq.all_ids, device=self.device)] = True
        return row

    def _new_row(self) -> int:
        if not self.free_rows:
            old = self.counts.shape[0]
            grown = max(8, 2 * old)
            pad = (grown - old, self.vocab_size)
            self.counts = torch.cat(
                (self.counts, torch.zeros(pad, dtype=torch.int32, device=self.device))
            )
            self.seen = torch.cat(
                (self.seen, torch.zeros(pad, dtype=torch.bool, device=self.device))
            )
            self.free_rows = list(range(grown - 1, old - 1, -1))
        return self.free_rows.pop()

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_(
            (rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
        )
        self.seen[rows, tokens] = True

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(_key(seq), None)
        if row is not None:
            self.free_rows.append(row)


@dataclass
class SamplingBatch:
    """The step's per-row parameters as tensors, built once per step from the sequences."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B], 1 where greedy
    top_k: torch.Tensor  # [B] int, V where none
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    any_min_p: bool

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device) -> SamplingBatch:
        params = [s.params for s in seqs]
        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            greedy=torch.tensor(greedy, device=device),
            temperature=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device
            ),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor(top_p, device=device),
            min_p=torch.tensor(min_p, device=device),
            any_min_p=any(p > 0 for p in min_p),
        )


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        device: torch.device,
        generator: torch.Generator | None = None,
    ):
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.device = device
        self.generator = generator  # draws of the unseeded rows (None: torch's default)
        self.penalties = PenaltyRows(vocab_size, device)

    def release(self, seq: Sequence) -> None:
        """The sequence is done: its penalty row goes back to the pool."""
        self.penalties.release(seq)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """A sequence whose logits hold NaN or +inf (its adapter's weights, say), or whose row
        cannot be sampled (every token banned), gets None: it fails alone, instead of failing the
        whole batch."""
        # logits: [B, V] float32, one row per sequence
        # NaN and +inf are a row's max: one pass finds the rows to fail
        top_values, top_tokens = logits.max(-1)
        finite = torch.isfinite(top_values)
        if all(_is_plain(s) for s in seqs):
            chosen, ok = top_tokens, finite
        else:
            chosen, ok = self._sample(logits, seqs)
            ok &= finite
        tokens = [t if good else None for t, good in zip(chosen.tolist(), ok.tolist())]
        return self._logprobs(logits, seqs, chosen, tokens)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.clone()
        grammar_mask(logits, seqs)
        self._bias_and_ban(logits, seqs)
        penalized = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
        if penalized:
            at = torch.tensor(penalized, device=self.device)
            self._penalize(logits, [seqs[i] for i in penalized], at)
        meta = SamplingBatch.build(seqs, self.vocab_size, self.device)
        greedy_tokens = logits.argmax(-1)
        ok = torch.isfinite(logits.max(-1).values)  # a row with every token banned: no sample
        if bool(meta.greedy.all()):
            return greedy_tokens, ok
        probs = (logits / meta.temperature[:, None]).softmax(-1)
        if meta.any_min_p:
            floor = meta.min_p[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        only_k = [
            i
            for i, s in enumerate(seqs)
            if 0 < s.params.top_k < self.vocab_size and s.params.top_p == 1.0
        ]
        if only_k:  # no sort: the k-th value is the threshold
            at = torch.tensor(only_k, device=self.device)
            probs[at] = _top_k(probs[at], meta.top_k[at])
        with_p = [i for i, s in enumerate(seqs) if s.params.top_p < 1.0]
        if with_p:
            at = torch.tensor(with_p, device=self.device)
            probs[at] = _top_k_top_p(probs[at], meta.top_k[at], meta.top_p[at])
        drawn = self._draw(probs, seqs)
        ok &= torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
        return torch.where(meta.greedy, greedy_tokens, drawn), ok

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A token per row from its (unnormalized) probabilities: the cumulative sum inverted at one
        uniform number per row (a seeded row's from its own generator)."""
        cdf = probs.cumsum(-1)
        u = torch.rand(len(seqs), device=self.device, generator=self.generator)
        seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
        if seeded:
            own = [torch.rand((), generator=seqs[i].generator, device=self.device) for i in seeded]
            u[torch.tensor(seeded, device=self.device)] = torch.stack(own)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        return drawn.clamp_(max=probs.shape[-1] - 1)

    def _bias_and_ban(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logit_bias added; the end tokens banned for a sequence under its min_tokens."""
        rows, cols, values, ban_rows, ban_cols = [], [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            for token, bias in p.logit_bias:
                rows.append(i), cols.append(token), values.append(bias)
            if len(seq.output_ids) < p.min_tokens:
                ends = (*self.eos_ids, *p.stop_token_ids)
                ban_rows += [i] * len(ends)
                ban_cols += ends
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            logits.index_put_(index, torch.tensor(values, device=self.device), accumulate=True)
        if ban_rows:
            logits[
                torch.tensor(ban_rows, device=self.device),
                torch.tensor(ban_cols, device=self.device),
            ] = NEG_INF

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence], at: torch.Tensor) -> None:
        """Repetition (over prompt and output), presence and frequency (over the output) penalties,
        as vLLM."""
        rows = torch.tensor([self.penalties.row_of(s) for s in seqs], device=self.device)
        counts = self.penalties.counts[rows].to(logits.dtype)
        seen = self.penalties.seen[rows]
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=self.device)[:, None]
        presence = torch.tensor([s.params.presence_penalty for s in seqs], device=self.device)[
            :, None
        ]
        frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=self.device)[
            :, None
        ]
        part = logits[at]
        scaled = torch.where(part > 0, part / rep, part * rep)
        part = torch.where(seen, scaled, part)
        part = part - frequency * counts - presence * (counts > 0).to(logits.dtype)
        logits[at] = part

    def record(self, seqs: list[Sequence], tokens: list[int | None]) -> None:
        """The sampled tokens join the penalty rows of the sequences that have them."""
        rows = self.penalties.rows
        picked = [
            (rows[_key(s)], t) for s, t in zip(seqs, tokens) if t is not None and _key(s) in rows
        ]
        if picked:
            rows, toks = zip(*picked)
            self.penalties.add(
                torch.tensor(rows, device=self.device), torch.tensor(toks, device=self.device)
            )

    def _logprobs(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        chosen: torch.Tensor,
        tokens: list[int | None],
    ) -> Sampled:
        """Logprobs from the model's distribution (before penalties and temperature), as vLLM
        returns them."""
        wanted = [
            i
            for i, s in enumerate(seqs)
            if tokens[i] is not None and (s.params.logprobs is not None or s.params.best_of)
        ]
        entries: list[dict | None] = [None] * len(seqs)
        token_lp: list[float | None] = [None] * len(seqs)
        if not wanted:
            return Sampled(tokens, entries, token_lp)
        at = torch.tensor(wanted, device=logits.device)
        lp = torch.log_softmax(logits[at], dim=-1)
        picked = lp.gather(1, chosen[at][:, None])[:, 0].tolist()
        k = max((seqs[i].params.logprobs or 0) for i in wanted)
        top_v, top_t = lp.topk(k) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_t = top_v.tolist(), top_t.tolist()
        for j, i in enumerate(wanted):
            token_lp[i] = picked[j]
            n = seqs[i].params.logprobs
            if n is not None:
                top = list(zip(top_t[j][:n], top_v[j][:n]))
                entries[i] = {"token": tokens[i], "logprob": picked[j], "top": top}
        return Sampled(tokens, entries, token_lp)


def _key(seq: Sequence) -> tuple[str, int]:
    return seq.request_id, seq.index


def _is_plain(seq: Sequence) -> bool:
    """Greedy with nothing that changes the logits: the argmax of the raw row."""
    p = seq.params
    return p.is_greedy and not p.needs_penalties and not p.min_tokens and seq.matcher is None


def _top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k most likely tokens (and any tied with the k-th)."""
    values = probs.topk(int(top_k.max()), -1).values
    kth = values.gather(1, top_k[:, None] - 1)
    return probs.masked_fill(probs < kth, 0.0)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k most likely tokens, then the smallest set of them reaching top_p (never
    less than the most likely one)."""
    sorted_probs, order = probs.sort(-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(ranks >= top_k[:, None], 0.0)
    total = sorted_probs.sum(-1, keepdim=True)
    before = (sorted_probs.cumsum(-1) - sorted_probs) / total  # mass of the likelier tokens
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
