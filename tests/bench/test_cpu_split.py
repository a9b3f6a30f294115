"""bench/cpu_split.py: py-spy's collapsed stacks of a real process and its child, split into the
parts of `vs_vllm_split.py`'s report by the files their frames run in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from cpu_split import attribute, parse, top_frames  # noqa: E402

PY_SPY = Path(sys.executable).with_name("py-spy")
BURN = "def burn(seconds):\n    import time\n    end = time.process_time() + seconds\n" + (
    "    while time.process_time() < end:\n        sum(range(1000))\n"
)


def _module(root: Path, relative: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BURN)
    return path


def _load(path: Path, name: str) -> str:
    return (
        f"spec = importlib.util.spec_from_file_location({name!r}, {str(path)!r})\n"
        f"{name} = importlib.util.module_from_spec(spec)\n"
        f"spec.loader.exec_module({name})\n"
    )


def test_a_parent_and_its_child_split_by_process_and_file(tmp_path):
    if not PY_SPY.is_file():
        pytest.skip("py-spy is not installed beside this interpreter")
    staging = _module(tmp_path, "site/loraplex/engines/vllm/staging.py")
    layer = _module(tmp_path, "site/loraplex/server/app.py")
    forward = _module(tmp_path, "site/torch/nn/modules/linear.py")
    child = tmp_path / "child.py"
    child.write_text("import importlib.util\n" + _load(forward, "forward") + "forward.burn(3)\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import importlib.util, subprocess, sys\n"
        + _load(staging, "staging")
        + _load(layer, "layer")
        + textwrap.dedent(f"""
            child = subprocess.Popen([sys.executable, {str(child)!r}])
            staging.burn(1.5)
            layer.burn(1.5)
            child.wait()
            """)
    )
    out = tmp_path / "stacks.txt"
    spy = subprocess.run(
        [
            str(PY_SPY),
            "record",
            "--subprocesses",
            "--full-filenames",
            "--format",
            "raw",
            "--rate",
            "100",
        ]
        + ["--output", str(out), "--", sys.executable, str(parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if spy.returncode != 0 and "ermission" in spy.stderr:
        pytest.skip(f"py-spy may not trace here: {spy.stderr.strip()[-200:]}")
    assert spy.returncode == 0, spy.stderr
    text = out.read_text()
    recorded = {pid for processes, _, _ in parse(text) for pid, _ in processes}
    # every chain starts at the process py-spy started, the parent script (py-spy may read its
    # command line before the exec, as "", so the pid is what names it)
    roots = {processes[0][0] for processes, _, _ in parse(text)}
    assert len(roots) == 1
    (api_pid,) = roots
    assert len(recorded) >= 2
    split = attribute(text, api_pid, {"api": 3.0, "engine": 3.0})
    parts = split["parts"]
    assert parts["staging"]["role"] == parts["loraplex serving layer"]["role"] == "api"
    assert parts["staging"]["samples"] > 0 and parts["loraplex serving layer"]["samples"] > 0
    assert parts["engine: model forward"]["role"] == "engine"
    assert parts["engine: model forward"]["samples"] > 0
    for role in ("api", "engine"):  # each role's busy samples split into its parts, whole
        mine = [p for p in parts.values() if p["role"] == role]
        assert sum(p["samples"] for p in mine) == split["busy_samples"][role]
        assert abs(sum(p["cpu_s"] for p in mine) - 3.0) < 0.01
    leaves = [leaf for leaf, _ in top_frames(text, api_pid)]
    assert any("staging.py" in leaf for leaf in leaves)
    assert not any("linear.py" in leaf for leaf in leaves)  # the child's frames are not the API's


def test_a_command_line_with_semicolons_stays_one_process_frame():
    line = (
        'process 7:"python -m vllm.entrypoints.openai.api_server";'
        'process 9:"python -c from multiprocessing.spawn import spawn_main; spawn_main(fd=5)";'
        "run (vllm/v1/engine/core.py:10);forward (torch/nn/modules/linear.py:125) 4"
    )
    ((processes, frames, count),) = list(parse(line))
    assert processes[-1][0] == 9 and "spawn_main(fd=5)" in processes[-1][1]
    assert frames == [("run", "vllm/v1/engine/core.py"), ("forward", "torch/nn/modules/linear.py")]
    assert count == 4
    split = attribute(line, 7, {"engine": 0.5})
    forward = {"role": "engine", "samples": 4, "share_of_role": 1.0, "cpu_s": 0.5}
    assert split["parts"] == {"engine: model forward": forward}
    idle = 'process 7:"python x.py";Runner.run (/usr/lib/python3.11/asyncio/runners.py:118) 9'
    assert attribute(idle, 7)["idle_samples"] == {"api": 9}  # uvloop waiting in C
