"""A throwaway PostgreSQL cluster's tools, for tests and benchmarks: the server's binaries, run
as the postgres user when running as root (initdb and the server refuse root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def postgres_bin() -> Path | None:
    """The newest installed server's binaries (`/usr/lib/postgresql/*/bin`), or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


def as_postgres() -> list[str]:
    """The prefix that runs a command as the postgres user when running as root; else none."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def run_tool(tool: str, *args: str, check: bool = True) -> int:
    """Run one of the server's binaries (`initdb`, `pg_ctl`) as the postgres user when running
    as root; its exit status."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)")
    command = [*as_postgres(), str(bin_dir / tool), *args]
    return subprocess.run(command, check=check, capture_output=True, timeout=120).returncode


def pg_ctl(work: Path, *args: str, check: bool = True) -> int:
    """`pg_ctl -D WORK/data -w ARGS` on a cluster made in `work`; its exit status. `restart` on
    a stopped cluster starts it with the options it last ran with."""
    return run_tool("pg_ctl", "-D", str(work / "data"), "-w", *args, check=check)
