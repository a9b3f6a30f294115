"""vLLM's pause of generation (`POST /pause`, `rl_api`): new generation requests wait, they are
not refused, until the resume; requests in flight go on."""

from __future__ import annotations

import asyncio


class GenerationPause:
    """Whether new generation requests may start; while paused they wait for the resume."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()

    @property
    def is_paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    async def wait(self) -> None:
        """Return once generation is not paused (at once when it is not)."""
        await self._resumed.wait()
