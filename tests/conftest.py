import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from tinymodels import make_adapters, make_model

from loraplex.loadgen.postgres import postgres_bin

torch.set_num_threads(2)


def pytest_addoption(parser):
    parser.addoption(
        "--engine-core",
        default="thread",
        choices=("thread", "process"),
        help="where the servers' native engine runs in the server tests (serve --engine-core; "
        "serve's default is process, these tests' thread: an engine process per test server "
        "makes tests/server slower, and tests/server/test_engine_process.py runs both)",
    )


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A command run in-process (`serve` sets up the process's logging) leaves the root logger as
    it found it: its handler writes to the test's captured stderr, closed once the test ends, and
    any later log line of any thread would fail on it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:  # pytest's own handlers are of other classes
        if handler not in handlers and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory):
    return make_adapters(llama_dir, tmp_path_factory.mktemp("llama-adapters"))


@pytest.fixture(scope="session")
def demo_world():
    """The trained demo world, built once per machine (cached) and shared by the whole run."""
    from loraplex.demo.world import build_world, default_world_dir

    return build_world(default_world_dir(), progress=False)


# ---- PostgreSQL: a throwaway cluster on a socket in a temp dir, when initdb exists ---------------


@pytest.fixture(scope="session")
def postgres_server():
    """(socket dir, run-as prefix) of a running throwaway cluster, or skip saying why there is
    none."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed")
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        if (
            shutil.which("runuser") is None
            or subprocess.run(["id", "postgres"], capture_output=True).returncode
        ):
            pytest.skip("running as root without a postgres user and runuser to start a cluster")
        as_user = ["runuser", "-u", "postgres", "--"]
    work = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    work.chmod(0o755)
    if as_user:
        shutil.chown(work, "postgres")
    data = work / "data"

    def run(*args):
        return subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)

    init = run(
        str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"
    )
    if init.returncode:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"initdb failed: {init.stderr.strip()[-300:]}")
    options = f"-k {work} -c listen_addresses='' -c fsync=off -c max_connections=60"
    start = run(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(work / "log"),
        "-w",
        "start",
    )
    if start.returncode:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"pg_ctl start failed: {start.stderr.strip()[-300:]}")
    try:
        yield work
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(work, ignore_errors=True)


_schema_numbers = itertools.count()


@pytest.fixture
def pg_url(postgres_server):
    """A fresh, empty PostgreSQL schema, as its own database URL (skips when no cluster could
    start).

    A schema per test rather than a database: CREATE DATABASE copies a template on disk each time.
    """
    import psycopg

    schema = f"t{next(_schema_numbers)}"
    with psycopg.connect(
        host=str(postgres_server), user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return (
        f"postgresql://postgres@/postgres?host={postgres_server}&options=-csearch_path%3D{schema}"
    )
