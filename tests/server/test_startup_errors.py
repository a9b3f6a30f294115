"""Bad input at start-up, as a user meets it: `serve` and `demo` as real processes end with exit
code 2 and one line on stderr naming the flag or file, never a traceback. The processes of one test
run side by side (each imports torch)."""

import shutil
import subprocess
import sys


def run_side_by_side(commands: dict[str, list]) -> dict[str, tuple[int, str]]:
    """name -> (exit code, stderr) of each `python -m ...` command, all started at once."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    try:
        return {name: (proc.wait(180), proc.communicate()[1]) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def assert_one_line_errors(
    results: dict[str, tuple[int, str]], expected: dict[str, tuple[str, ...]]
) -> None:
    """Each command exited 2 with one stderr line holding every expected fragment."""
    wrong = {}
    for name, (code, stderr) in results.items():
        lines = stderr.strip().splitlines()
        one_line = len(lines) == 1 and "Traceback" not in stderr and lines[0].startswith("error: ")
        if code != 2 or not one_line or not all(part in lines[0] for part in expected[name]):
            wrong[name] = (code, stderr[-600:])
    assert not wrong, wrong


def test_bad_serve_input_stops_with_exit_code_2_and_one_line(llama_dir, tmp_path):
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(llama_dir / "config.json", config_only)
    plain_file = tmp_path / "plain-file"
    plain_file.write_text("not a directory")
    latin1_keys = tmp_path / "latin1-keys"
    latin1_keys.write_bytes(b"caf\xe9 key-0123456789abcdef\n")
    not_a_db = tmp_path / "not-a-db.sqlite"
    not_a_db.write_text("not a database")
    config_list = tmp_path / "config-list"
    config_list.mkdir()
    (config_list / "config.json").write_text("[]")
    bad_tokenizer = tmp_path / "bad-tokenizer"
    shutil.copytree(llama_dir, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{")
    template_list = tmp_path / "template-list"
    shutil.copytree(llama_dir, template_list)
    (template_list / "tokenizer_config.json").write_text("[]")

    def serve(name: str, *args) -> list:
        return [
            "loraplex.server.cli",
            "--port",
            "0",
            "--device",
            "cpu",
            "--data-dir",
            tmp_path / name,
            *args,
        ]

    commands = {
        "bad json": serve("d1", "--model", bad_json),
        "no tokenizer": serve("d2", "--model", config_only),
        "data dir is a file": [
            "loraplex.server.cli",
            "--model",
            llama_dir,
            "--port",
            "0",
            "--device",
            "cpu",
            "--data-dir",
            plain_file,
        ],
        "unknown registry": serve("d3", "--model", llama_dir, "--registry", "bogus://x"),
        "not a database": serve("d4", "--model", llama_dir, "--registry", f"sqlite:///{not_a_db}"),
        "port out of range": serve("d5", "--model", llama_dir, "--port", "-5"),
        "keys not utf-8": serve("d6", "--model", llama_dir, "--api-keys", latin1_keys),
        "config is a list": serve("d7", "--model", config_list),
        "corrupt tokenizer": serve("d8", "--model", bad_tokenizer),
        "tokenizer config is a list": serve("d9", "--model", template_list),
    }
    expected = {
        "bad json": ("--model", "config.json"),
        "no tokenizer": ("--model", "tokenizer.json"),
        "data dir is a file": ("--data-dir", "not a directory"),
        "unknown registry": ("--registry", "bogus"),
        "not a database": ("--registry", "not a database"),
        "port out of range": ("--port -5",),
        "keys not utf-8": ("--api-keys", str(latin1_keys), "UTF-8"),
        "config is a list": ("--model", "config.json is not a JSON object"),
        "corrupt tokenizer": ("--model", "tokenizer.json"),
        "tokenizer config is a list": ("--model", "tokenizer_config.json is not a JSON object"),
    }
    assert_one_line_errors(run_side_by_side(commands), expected)


def test_demo_dir_that_cannot_be_made_stops_with_exit_code_2_and_one_line():
    results = run_side_by_side(
        {"dir under a file": ["loraplex.cli", "demo", "--dir", "/dev/null/x"]}
    )
    assert_one_line_errors(results, {"dir under a file": ("--dir /dev/null/x",)})
