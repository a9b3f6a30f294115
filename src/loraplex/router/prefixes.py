"""Which workers hold a prompt's prefix in their KV cache, as the router can tell without asking:
an approximate index per worker of the prompt blocks it routed there.

A prompt is cut into fixed-size blocks of what the router sees: characters of the text (a
completion's `prompt`, a chat's messages as role and content), or token ids when the prompt is
given as ids. The router has no tokenizer (it talks HTTP only, and the pools may hold bases with
different ones); a shared text prefix tokenizes to a shared token prefix up to about its last
token, so the worker's own cache matches where the router's blocks do. 64 characters are about 16
tokens, a KV block of vLLM's and of the native engine's.

Each block's hash chains the one before it and is salted with the adapter revision's digest: a KV
prefix is reusable only under the same revision, as the engines salt their own block hashes.
Because of the chain, a block found means its whole prefix was routed there. The index keeps the
most recently routed blocks of each worker, up to a bound (least recently routed out first), so
its memory is bounded and old prefixes age out as the worker's cache would drop them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

BLOCK_CHARS = 64
"""Characters per block of a text prompt (about 16 tokens)."""
BLOCK_TOKENS = 16
"""Token ids per block of a prompt given as ids."""
MAX_BLOCKS = 256
"""Blocks hashed per request at most: the first 16 KiB of a text prompt."""


def prompt_text(payload: dict[str, Any]) -> str | list[int] | None:
    """The prompt as the router sees it: text, or token ids (None: no prompt it can read)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]  # a batch: its first prompt
    messages = payload.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    return None


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"<{message.get('role')}>{content if isinstance(content, str) else ''}\n"


def block_hashes(prompt: str | list[int] | None, salt: str) -> tuple[int, ...]:
    """The hash chain of the prompt's full blocks, salted with the adapter revision's key."""
    if not prompt:
        return ()
    size = BLOCK_TOKENS if isinstance(prompt, list) else BLOCK_CHARS
    hashes, parent = [], salt.encode()
    for i in range(min(len(prompt) // size, MAX_BLOCKS)):
        chunk = prompt[i * size : (i + 1) * size]
        data = chunk.encode() if isinstance(chunk, str) else repr(chunk).encode()
        parent = hashlib.blake2b(parent + data, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "big"))
    return tuple(hashes)


class PrefixIndex:
    """One worker's prompt blocks, most recently routed last, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: tuple[int, ...]) -> float:
        """The share of the prompt's blocks whose prefix is here (0 to 1)."""
        if not hashes:
            return 0.0
        found = 0
        for h in hashes:
            if h not in self._blocks:
                break
            found += 1
        return found / len(hashes)

    def add(self, hashes: tuple[int, ...]) -> None:
        """The prompt went to this worker: its blocks are the most recent, the oldest beyond the
        capacity are dropped. The first blocks are the last to go: a prefix outlives its
        continuations (and a block without its prefix is never matched)."""
        blocks = self._blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
