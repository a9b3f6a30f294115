"""docker/Dockerfile (GPU, on vLLM's image) and docker/Dockerfile.cpu parsed (dockerfile-parse) and
checked against the tree, since no Docker engine builds them here: their COPY sources exist and
pass .dockerignore, every FROM names a tag, the wheel comes from a first stage, every install is
docker/install.sh, the entrypoint is a loraplex command with options it has, and the image runs as
a non-root user that the Helm chart's pods match."""

from __future__ import annotations

import fnmatch
import io
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import typer
import yaml
from dockerfile_parse import DockerfileParser

from loraplex.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _parser(name: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((ROOT / name).read_bytes()))


def _instructions(name: str) -> list[tuple[int, str, str]]:
    """(stage index, instruction, value) for each instruction, the stage counted from 0."""
    parser = _parser(name)
    stage, out = -1, []
    for item in parser.structure:
        if item["instruction"] == "FROM":
            stage += 1
        out.append((stage, item["instruction"], item["value"]))
    return out


def _final(name: str, instruction: str) -> list[str]:
    items = _instructions(name)
    last = items[-1][0]
    return [v for s, i, v in items if s == last and i == instruction]


def _stage_names(name: str) -> list[str]:
    names = []
    for _, instruction, value in _instructions(name):
        if instruction == "FROM":
            words = value.split()
            names.append(words[2] if len(words) == 3 and words[1].upper() == "AS" else "")
    return names


def _ignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` out of the build context (its last matching rule wins;
    a directory's rule covers what is under it)."""
    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        rule = line.strip()
        if not rule or rule.startswith("#"):
            continue
        keep = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/").removeprefix("**/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(Path(p).name, pattern) for p in prefixes
        ):
            ignored = not keep
    return ignored


def _exec_form(value: str) -> list[str]:
    words = json.loads(value)
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), value
    return words


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_exists_in_the_build_context(name):
    stages = _stage_names(name)
    copies = [(s, v) for s, i, v in _instructions(name) if i in ("COPY", "ADD")]
    assert copies
    for stage, value in copies:
        words = shlex.split(value)
        flags = [w for w in words if w.startswith("--")]
        sources = [w for w in words if not w.startswith("--")][:-1]
        source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if source_stage is not None:
            assert source_stage in stages[:stage], f"{value}: no earlier stage {source_stage}"
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: not in the tree"
            assert not _ignored(source), f"{name}: COPY {source}: left out by .dockerignore"
            if (ROOT / source).is_dir():
                files = [p for p in (ROOT / source).rglob("*.py")]
                assert files and not all(_ignored(str(p.relative_to(ROOT))) for p in files)


def test_the_dockerignore_keeps_the_venv_and_the_tests_out():
    for path in (
        ".venv/bin/python",
        "tests/conftest.py",
        ".git/HEAD",
        "src/loraplex/__pycache__/x.pyc",
    ):
        assert _ignored(path), path
    for path in (
        "src/loraplex/cli.py",
        "pyproject.toml",
        "requirements-core.lock",
        "docker/install.sh",
    ):
        assert not _ignored(path), path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_from_names_a_tag_and_the_wheel_comes_from_a_first_stage(name):
    stages = _stage_names(name)
    assert len(stages) >= 2 and stages[0]
    for _, instruction, value in _instructions(name):
        if instruction != "FROM":
            continue
        image = value.split()[0]
        if image in stages:
            continue
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag and tag not in ("", "latest"), f"FROM {image}"
    first = [v for s, i, v in _instructions(name) if s == 0 and i == "RUN"]
    assert any("pip wheel" in v for v in first)
    assert any(f"--from={stages[0]}" in v for v in _final(name, "COPY"))


def test_the_gpu_image_starts_from_vllms_image_at_the_version_the_extra_pins():
    (pin,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    version = pin.removeprefix("vllm==")
    base = [v for _, i, v in _instructions("docker/Dockerfile") if i == "FROM"][-1]
    assert base.split()[0] == f"vllm/vllm-openai:v{version}"
    cpu_base = [v for _, i, v in _instructions("docker/Dockerfile.cpu") if i == "FROM"][-1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", cpu_base.split()[0])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_package_install_is_the_install_script(name):
    runs = _final(name, "RUN")
    installs = [r for r in runs if "install.sh" in r]
    assert len(installs) == 1
    assert f"/build/wheels/loraplex-{VERSION}-py3-none-any.whl" in installs[0]
    mode = "gpu" if name == "docker/Dockerfile" else "cpu"
    assert f"install.sh {mode} " in installs[0]
    for run in runs:
        if run is not installs[0]:
            assert not re.search(r"pip\d* install|apt(-get)? install|uv pip|conda install", run)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_entrypoint_is_a_loraplex_command_with_options_it_has(name):
    (entrypoint,) = _final(name, "ENTRYPOINT")
    (cmd,) = _final(name, "CMD")
    words = _exec_form(entrypoint) + _exec_form(cmd)
    assert words[0] == "loraplex"
    command = typer.main.get_command(app)
    serve = command.commands[words[1]]
    assert words[1] == "serve"
    options = {opt for p in serve.params for opt in p.opts}
    for word in words[2:]:
        if word.startswith("--"):
            assert word.partition("=")[0] in options, word
    assert "--model=/models/base" in words  # the model comes from a volume, never the image
    if name == "docker/Dockerfile":
        assert words[2:4] == ["--engine", "vllm"]
    script = PYPROJECT["project"]["scripts"]["loraplex"]
    assert script == "loraplex.cli:app"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_nothing_model_like_is_baked_in(name):
    for _, instruction, value in _instructions(name):
        if instruction in ("COPY", "ADD"):
            assert "/models" not in value
        if instruction == "RUN":
            assert not re.search(r"huggingface-cli|hf download|snapshot_download|wget|curl", value)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_as_the_non_root_user_the_chart_expects(name):
    user = _final(name, "USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, "a numeric uid lets Kubernetes check runAsNonRoot"
    values = ROOT / "deploy/helm/loraplex/templates/worker.yaml"
    text = values.read_text()
    assert f"runAsUser: {uid}" in text and f"runAsGroup: {gid or uid}" in text
    assert "runAsNonRoot: true" in text


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_labels_and_the_health_check(name):
    labels = _parser(name).labels
    for key in ("title", "description", "source", "version"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    assert labels["org.opencontainers.image.version"] == VERSION
    (check,) = _final(name, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in check
    assert "--port=8000" in _exec_form(_final(name, "CMD")[0])


def test_the_install_script_is_valid_bash_and_refuses_an_unknown_target(tmp_path):
    script = ROOT / "docker/install.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(
        ["bash", str(script), "arm", "x.whl", "python3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "usage: install.sh cpu|gpu" in done.stderr


def test_the_chart_default_image_is_the_one_the_dockerfiles_build():
    chart = yaml.safe_load((ROOT / "deploy/helm/loraplex/Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    for name, tag in (("docker/Dockerfile", VERSION), ("docker/Dockerfile.cpu", f"{VERSION}-cpu")):
        header = (ROOT / name).read_text()
        assert f"-t ghcr.io/loraplex/loraplex:{tag} ." in header
