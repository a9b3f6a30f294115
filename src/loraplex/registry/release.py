"""Release checks run before a revision first gets traffic: prewarm, its eval set, its parity
reference (`parity`), a health probe."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.registry.errors import AdapterRejected, ReleaseCheckFailed
from loraplex.registry.parity import DEFAULT_FACTOR, Reference, judge
from loraplex.registry.records import RevisionRecord

MAX_EVAL_CASES = 10_000


@dataclass(frozen=True)
class EvalCase:
    """One line of an eval set: the completion of `prompt` must equal `expected` or contain
    `contains`."""

    prompt: str
    expected: str | None = None
    contains: str | None = None

    def passes(self, completion: str) -> bool:
        if self.expected is not None:
            return completion.strip() == self.expected.strip()
        return self.contains in completion


def parse_eval_set(text: str) -> tuple[EvalCase, ...]:
    """JSONL, one {"prompt", "expected" | "contains"} object a line; refusals name the line."""
    cases = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AdapterRejected("eval_set", f"line {number} is not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise AdapterRejected("eval_set", f'line {number} needs a string "prompt"')
        expected = item.get("expected") if isinstance(item.get("expected"), str) else None
        contains = None if expected is not None else item.get("contains")
        if expected is None and not isinstance(contains, str):
            raise AdapterRejected(
                "eval_set", f'line {number} needs a string "expected" or "contains"'
            )
        cases.append(EvalCase(item["prompt"], expected, contains))
    if not cases:
        raise AdapterRejected("eval_set", "the eval set has no cases")
    if len(cases) > MAX_EVAL_CASES:
        raise AdapterRejected("eval_set", f"{len(cases)} cases; at most {MAX_EVAL_CASES}")
    return tuple(cases)


@dataclass(frozen=True)
class ReleaseChecks:
    """The server plugs in real callables; each gets the revision being promoted."""

    prewarm: Callable[[RevisionRecord], None] | None = None
    complete: Callable[[RevisionRecord, str], str] | None = (
        None  # prompt -> completion by that revision
    )
    min_pass_rate: float = 1.0
    health_prompt: str = "Hello"
    score: Callable[[RevisionRecord | None, list[int]], list[float]] | None = None
    """(revision, token ids) -> the log-probability of each id after the first under that
    revision (None: the base model): the parity gate (`registry.parity`)."""
    parity_factor: float = DEFAULT_FACTOR

    def __post_init__(self):
        if not 0.0 <= self.min_pass_rate <= 1.0:
            raise ValueError(f"min_pass_rate must be in [0, 1], got {self.min_pass_rate}")

    def run(
        self,
        record: RevisionRecord,
        cases: tuple[EvalCase, ...],
        reference: Reference | None = None,
    ) -> dict:
        """Raise ReleaseCheckFailed saying which check failed and why; return a summary for the
        audit log."""
        summary: dict = {}
        if self.prewarm is not None:
            _guarded(record, "prewarm", lambda: self.prewarm(record))
            summary["prewarm"] = "ok"
        if cases:
            summary["eval"] = self._run_eval(record, cases)
        if reference is not None:
            summary["parity"] = self._run_parity(record, reference)
        if self.complete is not None:
            completion = _guarded(
                record, "health probe", lambda: self.complete(record, self.health_prompt)
            )
            if not isinstance(completion, str) or not completion.strip():
                raise ReleaseCheckFailed(
                    f"{record.model_id}: health probe: {self.health_prompt!r} gave an empty "
                    f"completion ({completion!r})"
                )
            summary["health"] = "ok"
        return summary

    def _run_parity(self, record: RevisionRecord, reference: Reference) -> dict:
        score = self.score
        if score is None:
            raise ReleaseCheckFailed(
                f"{record.model_id} has a parity reference, but no way to score tokens was given"
            )
        seqs = reference.sequences
        served = _guarded(record, "parity", lambda: [score(record, list(s.ids)) for s in seqs])
        base = _guarded(record, "parity", lambda: [score(None, list(s.ids)) for s in seqs])
        verdict = judge(reference, served, base, self.parity_factor)
        if not verdict.passed:
            raise ReleaseCheckFailed(verdict.line(f"{record.model_id}: parity gate:"))
        return {"distance": verdict.distance, "floor": verdict.floor, "tokens": verdict.tokens}

    def _run_eval(self, record: RevisionRecord, cases: tuple[EvalCase, ...]) -> str:
        if self.complete is None:
            raise ReleaseCheckFailed(
                f"{record.model_id} has an eval set, but no way to run completions was given"
            )
        failures = []
        for case in cases:
            try:
                completion = self.complete(record, case.prompt)
            except Exception as exc:  # a crash on one case is a failed case, reported below
                completion = f"<{type(exc).__name__}: {exc}>"
            if not case.passes(completion):
                failures.append((case, completion))
        passed = len(cases) - len(failures)
        rate = passed / len(cases)
        if rate < self.min_pass_rate:
            case, completion = failures[0]
            want = (
                f"expected {case.expected!r}"
                if case.expected is not None
                else f"expected {case.contains!r} in it"
            )
            raise ReleaseCheckFailed(
                f"{record.model_id}: eval set passed {passed}/{len(cases)} ({rate:.0%}), below the "
                f"required {self.min_pass_rate:.0%}; first failure: prompt {case.prompt!r} gave "
                f"{completion!r}, {want}"
            )
        return f"{passed}/{len(cases)}"


def _guarded(record: RevisionRecord, check: str, call):
    try:
        return call()
    except ReleaseCheckFailed:
        raise
    except Exception as exc:
        raise ReleaseCheckFailed(
            f"{record.model_id}: {check} failed: {type(exc).__name__}: {exc}"
        ) from exc
