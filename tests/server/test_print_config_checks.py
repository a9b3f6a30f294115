"""`serve --print-config` checks what `serve` checks on this machine before it starts (the model
directory, the option files, the data directory, the store, the allowed roots, --lora-modules,
the registry URL's form, that the ports are free) and refuses with the same one line; it writes
nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplex.cli import app


def _run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["serve", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def listening():
    """A port something already listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def _cases(tmp: Path, busy: int) -> list[tuple[list, str]]:
    (tmp / "a-file").write_text("x")
    return [
        (["--model", tmp / "nope"], f"error: --model {tmp / 'nope'}: not a model directory"),
        (["--allowed-roots", tmp / "gone"], f"error: --allowed-roots {tmp / 'gone'}: no such"),
        (["--allowed-roots", "ftp://files/x"], "error: --allowed-roots ftp://files/x: unsupported"),
        (["--lora-modules", f"sql={tmp / 'gone'}"], f"error: --lora-modules sql={tmp / 'gone'}"),
        (["--data-dir", tmp / "a-file" / "d"], f"{tmp / 'a-file'} is not a directory"),
        (["--port", busy], f"error: --port {busy}: cannot listen on 127.0.0.1"),
        (["--registry", "mysql://u:pw@db/x"], "unsupported registry URL (scheme 'mysql')"),
        (["--registry", "$(LORAPLEX_REGISTRY_URL)"], "LORAPLEX_REGISTRY_URL is not set"),
        (["--api-keys", tmp / "keys"], "error: --api-keys: "),
        (["--store", tmp / "a-file" / "s"], f"error: --store {tmp / 'a-file' / 's'}: "),
        (["--storage-base", "ftp://files/x"], "error: --storage-base: storage base 'ftp://"),
        (["--storage-base", "https://a/loras"], "--storage-base https://a/loras: serve uploads"),
    ]


def test_print_config_refuses_what_serve_refuses_on_this_machine(llama_dir, tmp_path, listening):
    for args, message in _cases(tmp_path, listening):
        if "--model" not in args:
            args = ["--model", llama_dir, *args]
        if "--data-dir" not in args:
            args += ["--data-dir", tmp_path / "data"]
        if "--port" not in args:
            args += ["--port", "0"]
        lines = []
        for last in ("--print-config", "--max-loras=1"):  # serve stops at the same line
            code, out, err = _run(*args, last)
            assert code == 2 and out == "", (args, err)
            lines.append(err.strip().splitlines())
        assert len(lines[0]) == 1 and message in lines[0][0], (message, lines)
        assert lines[0] == lines[1]
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_print_config_of_good_settings_writes_nothing_and_leaves_the_port_free(llama_dir, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "roots").mkdir()
    code, out, err = _run(
        "--model", llama_dir, "--data-dir", tmp_path / "data", "--port", port,
        "--allowed-roots", tmp_path / "roots", "oci://registry.internal/loras", "--print-config",
    )  # fmt: skip
    assert code == 0, err
    assert f"port: {port}" in out
    assert not (tmp_path / "data").exists()
    with socket.socket() as again:  # let go: serve can take it
        again.bind(("127.0.0.1", port))
