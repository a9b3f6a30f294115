"""Per-request sampling over one step's last-token logits."""

from __future__ import annotations

import torch

from loraplex.engine.sequence import Sequence


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    for token, bias in p.logit_bias:
        row[token] += bias
    if p.repetition_penalty != 1.0 and len(seq):
        seen = torch.tensor(sorted(set(seq.all_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
    return row


def _ban_end(row: torch.Tensor, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
    """min_tokens: the sequence may not end yet."""
    if len(seq.output_ids) < seq.params.min_tokens:
        for token in (*eos_ids, *seq.params.stop_token_ids):
            row[token] = float("-inf")


def _sample_row(row: torch.Tensor, seq: Sequence) -> int | None:
    """The next token; None when the row cannot be sampled (every token banned, or non-finite values)."""
    p = seq.params
    if p.is_greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = row.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and never less than the most likely token (a top_p that rounds to 0 in float32)
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = row.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        return None
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list[Sequence],
           eos_ids: tuple[int, ...]) -> tuple[list[int | None], list[dict | None]]:
    """Next token per sequence and, where asked, its logprob and the top alternatives. A sequence whose logits hold
    NaN or +inf (its adapter's weights, say), or whose row cannot be sampled, gets None: it fails alone, instead of
    an error in the sampling failing the whole batch."""
    # logits: [B, V] float32, one row per sequence
    top_values, top_tokens = logits.max(-1)  # NaN and +inf are a row's max: one pass finds the rows to fail
    finite = torch.isfinite(top_values).tolist()
    simple = all(s.params.is_greedy and not s.params.needs_penalties and not s.params.min_tokens for s in seqs)
    if simple:
        tokens = top_tokens.tolist()
    else:
        tokens = []
        for i, seq in enumerate(seqs):
            if not finite[i]:
                tokens.append(None)
                continue
            row = logits[i].clone()
            _ban_end(row, seq, eos_ids)
            tokens.append(_sample_row(_apply_penalties(row, seq), seq))
    tokens = [t if ok else None for t, ok in zip(tokens, finite)]
    logprobs: list[dict | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and tokens[i] is not None]
    if wanted:
        lp = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in zip(lp, wanted):
            k = seqs[i].params.logprobs
            top = torch.topk(row, k) if k else None
            logprobs[i] = {
                "token": tokens[i],
                "logprob": float(row[tokens[i]]),
                "top": [(int(t), float(v)) for v, t in zip(*top)] if top else [],
            }
    return tokens, logprobs
