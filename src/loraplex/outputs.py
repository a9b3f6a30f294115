"""Output files checked before the work that fills them: a bad path is one line at the start, not a
traceback after a long run."""

from __future__ import annotations

import tempfile
from pathlib import Path


def unwritable(path: Path) -> str | None:
    """Why an output file cannot be written (None: it can), found before a run: its path is a
    directory, its nearest existing folder is a file, or writing there is refused (tried, as
    permissions alone do not tell: root, /proc, a read-only mount). Nothing is left behind."""
    if path.is_dir():
        return "a directory"
    folder = next(p for p in path.parents if p.exists())  # made with its parents on writing
    if not folder.is_dir():
        return f"{folder} is not a directory"
    try:
        if path.exists():
            with open(path, "ab"):  # appends nothing: the file is left as it is
                pass
        elif folder == path.parent:
            with tempfile.TemporaryFile(dir=folder):
                pass
        else:
            tempfile.TemporaryDirectory(dir=folder).cleanup()
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None
