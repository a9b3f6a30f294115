"""The parity gate: a revision served against its trainer.

A revision may carry a reference: token sequences, with the trainer's log-probability of each
token after the first under the adapter and under the bare base model. `verify` has a worker score
the same tokens (an OpenAI completion with `echo` and `logprobs`, on any engine or through the
router) and compares the pooled mean absolute per-token distance with the noise floor measured in
the same run: the bare base model served against the trainer's base log-probabilities. A revision
beyond `factor` times the floor is refused. Greedy text passes an adapter whose LoRA scale is off by
a few percent; this check does not.

`write_reference` makes a reference with HF transformers and PEFT, for trainers that export none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from loraplex.registry import queries as q
from loraplex.registry.db import ParityReference, Revision, utcnow
from loraplex.registry.errors import AdapterNotFound, AdapterRejected, RegistryError
from loraplex.registry.store import Store

FORMAT = "loraplex-reference/1"
DEFAULT_FACTOR = 2.0
"""A revision farther from its trainer than this many noise floors is refused."""
MIN_FLOOR = 1e-4
"""The floor's least value (log-probability units): two float32 runs of one model can agree to the
last bit, and a floor of 0 would refuse rounding."""
MAX_TOKENS = 100_000


@dataclass(frozen=True)
class Scored:
    """One token sequence and the trainer's log-probabilities of `ids[1:]`."""

    ids: tuple[int, ...]
    adapter: tuple[float, ...]
    base: tuple[float, ...]


@dataclass(frozen=True)
class Reference:
    sequences: tuple[Scored, ...]

    def to_json(self) -> str:
        rows = [{"ids": s.ids, "adapter": s.adapter, "base": s.base} for s in self.sequences]
        return json.dumps({"format": FORMAT, "sequences": rows})


def parse_reference(text: str) -> Reference:
    """A reference file's JSON; AdapterRejected naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AdapterRejected("reference", f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise AdapterRejected("reference", f'needs "format": "{FORMAT}"')
    rows = data.get("sequences")
    if not isinstance(rows, list) or not rows:
        raise AdapterRejected("reference", 'needs a non-empty "sequences" list')
    sequences, total = [], 0
    for i, row in enumerate(rows):
        try:
            ids = tuple(int(t) for t in row["ids"])
            adapter = tuple(float(x) for x in row["adapter"])
            base = tuple(float(x) for x in row["base"])
        except (TypeError, KeyError, ValueError):
            raise AdapterRejected(
                "reference", f'sequence {i} needs "ids", "adapter" and "base" lists of numbers'
            ) from None
        if len(ids) < 2 or len(adapter) != len(ids) - 1 or len(base) != len(ids) - 1:
            raise AdapterRejected(
                "reference",
                f"sequence {i}: at least 2 ids, and one adapter and one base log-probability "
                "per id after the first",
            )
        total += len(ids)
        sequences.append(Scored(ids, adapter, base))
    if total > MAX_TOKENS:
        raise AdapterRejected("reference", f"{total} tokens; at most {MAX_TOKENS}")
    return Reference(tuple(sequences))


@dataclass(frozen=True)
class Verdict:
    distance: float  # the served revision against the trainer's adapter log-probabilities
    floor: float  # the served base model against the trainer's base log-probabilities
    factor: float
    tokens: int

    @property
    def passed(self) -> bool:
        return self.distance <= self.factor * max(self.floor, MIN_FLOOR)

    def line(self, target: str) -> str:
        word = "passes" if self.passed else "refused"
        return (
            f"{target} {word}: mean per-token log-probability distance {self.distance:.3g} "
            f"against a noise floor of {self.floor:.3g} (limit {self.factor:g} x "
            f"{max(self.floor, MIN_FLOOR):.3g}) over {self.tokens} tokens"
        )


def distance(served: Sequence[Sequence[float]], expected: Iterable[Sequence[float]]) -> float:
    """The pooled mean absolute difference over every token."""
    diffs = [abs(a - b) for s, e in zip(served, expected, strict=True) for a, b in zip(s, e)]
    return sum(diffs) / len(diffs)


def judge(
    reference: Reference,
    served_adapter: Sequence[Sequence[float]],
    served_base: Sequence[Sequence[float]],
    factor: float = DEFAULT_FACTOR,
) -> Verdict:
    seqs = reference.sequences
    return Verdict(
        distance(served_adapter, (s.adapter for s in seqs)),
        distance(served_base, (s.base for s in seqs)),
        factor,
        sum(len(s.adapter) for s in seqs),
    )


def served_logprobs(client: httpx.Client, model: str, ids: Sequence[int]) -> list[float]:
    """The server's log-probability of each of `ids[1:]` under `model`: its echoed prompt's."""
    r = client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": list(ids),
            "max_tokens": 1,
            "temperature": 0,
            "echo": True,
            "logprobs": 0,
        },
    )
    if r.status_code != 200:
        raise RegistryError(f"the server answered {model} with {r.status_code}: {r.text[:300]}")
    scored = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    if len(scored) != len(ids) - 1 or any(lp is None for lp in scored):
        raise RegistryError(f"the server gave no log-probability for some of {model}'s tokens")
    return [float(lp) for lp in scored]


def verify(
    client: httpx.Client,
    reference: Reference,
    model: str,
    base_model: str,
    factor: float = DEFAULT_FACTOR,
) -> Verdict:
    """Score the reference's tokens under `model` (`name@revision`) and the bare `base_model`."""
    seqs = reference.sequences
    adapter = [served_logprobs(client, model, s.ids) for s in seqs]
    base = [served_logprobs(client, base_model, s.ids) for s in seqs]
    return judge(reference, adapter, base, factor)


# -- the registry's record -------------------------------------------------------------------------
def _revision(session, name: str, revision: str) -> Revision:
    row = q.find_revision(session, name, revision, None)
    if row is None:
        raise AdapterNotFound(f"{name}@{revision}")
    return row


def set_reference(store: Store, name: str, revision: str, text: str) -> Reference:
    """Attach a reference to a revision (replacing one it had); audited."""
    reference = parse_reference(text)
    with store.write() as session:
        row = _revision(session, name, revision)
        record = session.get(ParityReference, row.id)
        if record is None:
            session.add(ParityReference(revision_id=row.id, reference=text, created_at=utcnow()))
        else:
            record.reference, record.created_at = text, utcnow()
        store.audit(
            session,
            "reference",
            f"{name}@{revision}",
            sequences=len(reference.sequences),
            tokens=sum(len(s.ids) for s in reference.sequences),
        )
    return reference


def read_reference(store: Store, name: str, revision: str) -> Reference | None:
    with store.read() as session:
        record = session.get(ParityReference, _revision(session, name, revision).id)
        return None if record is None else parse_reference(record.reference)


def record_verdict(store: Store, name: str, revision: str, verdict: Verdict) -> None:
    with store.write() as session:
        store.audit(
            session,
            "verify",
            f"{name}@{revision}",
            passed=verdict.passed,
            distance=verdict.distance,
            floor=verdict.floor,
            factor=verdict.factor,
        )


# -- writing a reference with HF transformers and PEFT ---------------------------------------------
def write_reference(model_dir: Path, adapter_dir: Path, sequences: list[list[int]]) -> Reference:
    """The reference an HF+PEFT trainer would export: float32, on the CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()

    def scored(ids: list[int]) -> list[float]:
        tokens = torch.tensor([ids])
        logits = model(input_ids=tokens).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(1, tokens[0, 1:, None])[:, 0].tolist()

    out = []
    with torch.no_grad():
        for ids in sequences:
            adapter = scored(ids)
            with model.disable_adapter():
                base_lp = scored(ids)
            out.append(Scored(tuple(ids), tuple(adapter), tuple(base_lp)))
    return Reference(tuple(out))
