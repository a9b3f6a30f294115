"""Traffic for fault runs (tests and benchmarks): closed-loop clients streaming greedy completions
through a router, each request recorded with the worker that served it, its token ids, when it was
sent and ended, and whether its stream finished; and the counts such a run is judged by."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx


def stream_greedy(http: httpx.Client, url: str, model: str, prompt: list[int], n: int) -> dict:
    """One streamed greedy completion of `n` tokens: its status, the worker and the route the
    router named, its token ids, and whether the stream ended with [DONE] (else the error that
    broke it)."""
    # logprobs: a chunk for every token, so each one's id comes back (a token whose text is held
    # back, half a character, otherwise comes in no chunk)
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    record: dict = {"model": model, "ids": [], "done": False, "sent": time.monotonic()}
    try:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            record["status"], record["worker"] = r.status_code, r.headers.get("x-loraplex-worker")
            record["route"] = r.headers.get("x-loraplex-route")
            if r.status_code != 200:
                record["body"] = r.read().decode(errors="replace")[:300]
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    record["done"] = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices", []):
                        record["ids"] += choice.get("token_ids") or []
    except httpx.HTTPError as exc:
        record["error"] = type(exc).__name__
    record["ended"] = time.monotonic()
    return record


class ClosedLoop:
    """`clients` threads streaming completions over `models` in turn until stopped; `models` may
    grow while they run."""

    def __init__(
        self, url: str, models: list[str], prompt: list[int], n: int, clients: int = 3
    ) -> None:
        self.url, self.models, self.prompt, self.n = url, models, prompt, n
        self.records: list[dict] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(c,)) for c in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, offset: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = offset
            while not self.stopping.is_set():
                model = self.models[i % len(self.models)]
                self.records.append(stream_greedy(http, self.url, model, self.prompt, self.n))
                i += 1

    def wait_for_more(self, count: int, timeout: float = 120) -> None:
        """Until `count` more requests ended (a bound against hangs, not a timing figure)."""
        target, deadline = len(self.records) + count, time.monotonic() + timeout
        while len(self.records) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.records)} of {target} requests ended")
            time.sleep(0.05)

    def stop(self) -> list[dict]:
        self.stopping.set()
        for t in self.threads:
            t.join()
        return self.records


@dataclass(frozen=True)
class FaultCounts:
    requests: int
    answered: int
    wrong: int
    """Answered, with token ids other than the reference's."""
    failed: int
    failed_elsewhere: int
    """Failed, and not a request sent to the killed worker before it was killed."""
    answered_while_registry_down: int
    answered_after: int
    """Answered after the registry came back."""


def fault_counts(
    records: list[dict],
    expected: dict[str, list[int]],
    victim: str,
    killed_at: float,
    registry_down: tuple[float, float],
) -> FaultCounts:
    failed = [r for r in records if not (r.get("status") == 200 and r["done"])]
    answered = [r for r in records if r.get("status") == 200 and r["done"]]
    down_from, down_until = registry_down
    return FaultCounts(
        requests=len(records),
        answered=len(answered),
        wrong=sum(r["ids"] != expected[r["model"]] for r in answered),
        failed=len(failed),
        failed_elsewhere=sum(
            not (r.get("worker") == victim and r["sent"] < killed_at) for r in failed
        ),
        answered_while_registry_down=sum(
            down_from < r["sent"] and r["ended"] < down_until for r in answered
        ),
        answered_after=sum(r["sent"] > down_until for r in answered),
    )
