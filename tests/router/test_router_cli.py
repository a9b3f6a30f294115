"""`loraplex router` as a real process: an admin token file that is missing or too short, or a
registry it cannot read, stops it with exit code 2 and one line on stderr naming the flag, as
`serve` does."""

import subprocess
import sys


def test_bad_admin_token_file_stops_the_router_with_exit_code_2_and_one_line(tmp_path):
    empty = tmp_path / "empty-token"
    empty.write_text("")
    short = tmp_path / "short-token"
    short.write_text("short\n")
    files = [tmp_path / "missing-token", empty, short, short]
    flags = ["--admin-token-file"] * 3 + ["--metrics-token-file"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loraplex.cli",
                "router",
                "--worker",
                "http://127.0.0.1:9",
                "--port",
                "0",
                flag,
                str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag, path in zip(flags, files)
    ]
    try:
        results = [(proc.wait(60), proc.communicate()[1]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for flag, path, (code, stderr) in zip(flags, files, results, strict=True):
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, (
            path,
            code,
            stderr[-600:],
        )
        assert lines[0].startswith(f"error: {flag}") and path.name in lines[0], lines


def test_the_commands_that_do_not_serve_do_not_load_torch():
    """`loraplex router`, `registry`, `simulate`, `plan` and `bench` start without torch (about 2.5
    s and 300 MB less per process): only `serve` and `demo` load it, when they build the engine."""
    probe = (
        "import sys, loraplex.cli, loraplex.router.serve, loraplex.server.serve; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_registry_the_router_cannot_read_stops_it_with_one_line_and_creates_nothing(
    tmp_path, pg_url
):
    """The router only reads the registry: a missing SQLite file stays missing, an empty database
    stays empty, and each is one line naming --registry, as serve's."""
    missing = tmp_path / "nowhere" / "registry.db"
    cases = {
        f"sqlite:///{missing}": f"error: --registry: no registry at {missing}: create it with "
        "`loraplex registry init`",
        "mysql://u:pw@db/x": "error: --registry: unsupported registry URL (scheme 'mysql'): give "
        "sqlite:///FILE, postgresql://... or postgresql+psycopg://...",
        "postgresql://u@/x?host=/nonexistent": "error: --registry: cannot open the registry: ",
        pg_url: "is not initialized: run `loraplex registry init`",
    }
    procs = {
        url: subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "router", "--worker", "http://127.0.0.1:9"]
            + ["--port", "0", "--registry", url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url in cases
    }
    try:
        results = {url: (proc.wait(60), proc.communicate()[1]) for url, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for url, (code, stderr) in results.items():
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and cases[url] in lines[0], (url, stderr)
    assert not missing.parent.exists()
    import psycopg

    with psycopg.connect(pg_url) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()"
        ).fetchone()
    assert tables == (0,)
