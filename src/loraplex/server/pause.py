"""vLLM's pause of generation (`POST /pause`, `rl_api`): new generation requests wait, they are
not refused, until the resume; requests in flight go on. A pause given a timeout resumes by itself
once it has lasted that long, so that a trainer that dies before its `/resume` does not leave the
worker paused."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("loraplex.server")


class GenerationPause:
    """Whether new generation requests may start; while paused they wait for the resume."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def is_paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self, timeout_s: float | None = None) -> None:
        """Pause from now; with `timeout_s`, until the resume or that many seconds, whichever
        comes first (a later pause sets its own timeout, or none). Call on the event loop."""
        self._cancel_expiry()
        self._resumed.clear()
        if timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(timeout_s, self._expire, timeout_s)

    def resume(self) -> None:
        self._cancel_expiry()
        self._resumed.set()

    async def wait(self) -> None:
        """Return once generation is not paused (at once when it is not)."""
        await self._resumed.wait()

    def _expire(self, timeout_s: float) -> None:
        self._expiry = None
        log.warning(
            "generation resumed: paused for %g s (its timeout) without a /resume", timeout_s
        )
        self._resumed.set()

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
