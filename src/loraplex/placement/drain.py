"""`loraplex drain`: ask a worker to drain (`POST /admin/drain`) and wait until its state says it
is drained (the placement controller has moved what it placed there, no request is in flight)."""

from __future__ import annotations

import time

import httpx

POLL_S = 0.5


class DrainError(Exception):
    """The worker refused the drain, or could not be asked."""


def drain_worker(url: str, token: str, timeout_s: float) -> bool:
    """Whether the worker is drained within `timeout_s`."""
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(headers=headers, timeout=10) as client:
        try:
            answer = client.post(f"{url}/admin/drain")
        except httpx.HTTPError as exc:
            raise DrainError(f"{url}: {exc}") from None
        if answer.status_code != 200:
            raise DrainError(f"{url}/admin/drain: {answer.status_code} {answer.text[:200]}")
        drain = answer.json().get("drain")
        while drain != "drained" and time.monotonic() < deadline:
            time.sleep(POLL_S)
            try:
                drain = client.get(f"{url}/admin/state").json().get("drain")
            except (httpx.HTTPError, ValueError):
                drain = None  # asked again until the deadline
        return drain == "drained"
