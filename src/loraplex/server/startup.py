"""What `serve` raises for a bad option or input, and how a configuration's message names the
flags."""

from __future__ import annotations

import re

from loraplex.settings.serve import ServeSettings


class StartupError(Exception):
    """A bad option or input found before serving; the message is the one line printed (exit 2)."""


def flag_message(message: str) -> str:
    """A configuration's message with its setting names written as their flags."""
    for name in sorted(ServeSettings.__dataclass_fields__, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
    return message
