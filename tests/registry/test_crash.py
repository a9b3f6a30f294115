"""kill -9 of `loraplex registry add` at its worst moments leaves the database as it was before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from sqlalchemy import text

# Runs `registry add` in a child process that stops at one point and says so; the test then kills
# it.
CHILD = r"""
import sys, time
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session
from loraplex.registry.cli import app
from loraplex.artifacts import ArtifactStore

point, argv = sys.argv[1], sys.argv[2:]

def pause(*_):
    print("PAUSED", flush=True)
    time.sleep(120)

if point == "store":  # bytes copied and synced, not yet renamed into place
    adopt = ArtifactStore.adopt
    ArtifactStore.adopt = lambda self, work, digest: (pause(), adopt(self, work, digest))[1]
elif point == "flush":  # the revision row is written inside the open transaction
    @event.listens_for(Session, "after_flush")
    def after_flush(session, _ctx):
        if any(type(o).__name__ == "Revision" for o in session.new):
            pause()
elif point == "commit":  # every row written, the COMMIT about to be sent
    event.listen(Engine, "commit", pause)
app(argv, prog_name="loraplex registry")
"""


@pytest.mark.parametrize(
    ("backend", "point"),
    [("sqlite", "store"), ("sqlite", "flush"), ("sqlite", "commit"), ("postgresql", "commit")],
)
def test_kill_during_add_leaves_no_half_revision(
    backend, point, request, make_registry, adapter_v1, adapter_v2, llama_dir, resolve
):
    db_url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    registry = make_registry(db_url)
    registry.add_revision(adapter_v1, "chat", status="stable")
    before = (registry.show("chat"), registry.audit_events())
    args = [
        "--registry",
        db_url,
        "--store",
        str(registry.store.root),
        "add",
        str(adapter_v2),
        "--name",
        "chat",
        "--base-model",
        str(llama_dir),
        "--stable",
    ]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, point, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "PAUSED", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    assert (registry.show("chat"), registry.audit_events()) == before
    assert resolve(registry, "default", "chat").revision == "r1"
    if registry.engine.dialect.name == "sqlite":
        with registry.engine.connect() as conn:
            assert conn.execute(text("PRAGMA integrity_check")).scalar() == "ok"
    # the interrupted registration can simply be run again
    record = registry.add_revision(adapter_v2, "chat", status="stable")
    assert (record.revision, record.traffic_weight) == ("r2", 100)
    assert registry.store.get(record.digest)
