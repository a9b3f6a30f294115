"""What the controller asks of workers over their admin API: the quality gate (a revision's eval
set run with the canary and with the stable) and the canary pool's prewarm and activation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx


class WorkerError(RuntimeError):
    """A worker refused or failed an admin call; the message says which and why."""


@dataclass(frozen=True)
class GateResult:
    passed: bool
    detail: dict
    reason: str


def _post(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    try:
        return client.post(url, json=body)
    except httpx.HTTPError as exc:
        raise WorkerError(f"{url}: {exc}") from None


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


class QualityGate:
    """The canary's eval set on one worker, with the canary and with the stable revision: the
    canary passes when its pass rate is at most `margin` below the stable's."""

    def __init__(self, worker: str, client: httpx.Client, margin: float):
        self.worker, self.client, self.margin = worker, client, margin
        self._stable: dict[tuple[str, str, str], dict] = {}  # the stable's result, once a rollout

    def run(self, name: str, revision: str, cases_of: str) -> dict | None:
        """{"passed", "total", ...}, None when `cases_of` has no eval set."""
        url = f"{self.worker}/admin/adapters/{name}/eval"
        r = _post(self.client, url, {"revision": revision, "cases_of": cases_of})
        if r.status_code == 409:
            return None
        if r.status_code != 200:
            raise WorkerError(f"{url}: {r.status_code} {_message(r)}")
        return r.json()

    def check(self, name: str, canary: str, stable: str) -> GateResult:
        mine = self.run(name, canary, canary)
        if mine is None:
            return GateResult(True, {"eval": "none"}, f"{name}@{canary} has no eval set")
        key = (name, stable, canary)
        if key not in self._stable:
            self._stable[key] = self.run(name, stable, canary) or {"passed": 0, "total": 1}
        theirs = self._stable[key]
        rate, stable_rate = mine["passed"] / mine["total"], theirs["passed"] / theirs["total"]
        detail = {
            "canary": f"{mine['passed']}/{mine['total']}",
            "stable": f"{theirs['passed']}/{theirs['total']}",
            "margin": self.margin,
            "failures": mine.get("failures", []),
        }
        passed = rate >= stable_rate - self.margin - 1e-9
        reason = (
            f"eval set passed {mine['passed']}/{mine['total']} ({rate:.0%}) against the "
            f"stable's {theirs['passed']}/{theirs['total']} ({stable_rate:.0%}), margin "
            f"{self.margin:.0%}"
        )
        return GateResult(passed, detail, reason)


def canary_pool(workers: tuple[str, ...], named: tuple[str, ...], share: float) -> tuple[str, ...]:
    """The named workers, else the first `share` of them (at least one; none for a share of 0)."""
    if named:
        return named
    if not workers or share <= 0:
        return ()
    return workers[: max(1, math.ceil(share * len(workers)))]


def prewarm(client: httpx.Client, pool: tuple[str, ...], name: str, revision: str) -> None:
    """Into host memory, then a device slot, on each worker of the pool."""
    for url in pool:
        for tier in ("cpu", "gpu"):
            target = f"{url}/admin/adapters/{name}/prewarm"
            r = _post(client, target, {"revision": revision, "tier": tier})
            if r.status_code != 200:
                raise WorkerError(f"{target} ({tier}): {r.status_code} {_message(r)}")


def wait_active(
    client: httpx.Client, pool: tuple[str, ...], name: str, revision: str, timeout_s: float
) -> list[str]:
    """Until the revision is in a device slot on each worker of the pool (or the timeout); the
    workers where it is not."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pool)
    while waiting and time.monotonic() < deadline:
        waiting = [url for url in waiting if not _in_slot(client, url, name, revision)]
        if waiting:
            time.sleep(0.1)
    return waiting


def _in_slot(client: httpx.Client, url: str, name: str, revision: str) -> bool:
    try:
        state = client.get(f"{url}/admin/state").json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(
        a["name"] == name and a["revision"] == revision and a["tier"] == "gpu"
        for a in state.get("adapters", ())
    )
