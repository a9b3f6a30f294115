"""`loraplex demo` as a user runs it: a real process, every checked answer right, the last line N/N
correct."""

import re
import subprocess
import sys


def test_loraplex_demo_ends_with_all_checked_requests_correct(demo_world):
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "demo", "--dir", str(demo_world.root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    match = re.fullmatch(r"(\d+)/(\d+) correct", lines[-1].strip())
    assert match and match[1] == match[2] and int(match[2]) >= 20, (
        done.stdout[-2000:] + done.stderr[-2000:]
    )
    assert done.returncode == 0
    assert "HTTP 404" in done.stdout  # the cross-tenant requests were refused
    assert "curl -s http://127.0.0.1:" in done.stdout
