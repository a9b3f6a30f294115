"""The cache key: equal keys hash alike, in this process and in another (the hash is kept, not
pickled)."""

import dataclasses
import os
import subprocess
import sys

from loraplex.residency.key import AdapterKey


def test_equal_keys_hash_alike_and_any_field_makes_another_key():
    key = AdapterKey("sha256:base", "support", "r2", "sha256:bytes")
    same = AdapterKey("sha256:base", "support", "r2", "sha256:bytes")
    assert key == same and hash(key) == hash(same) and {key: 1}[same] == 1
    for field in (
        "base_model_digest",
        "name",
        "revision",
        "adapter_digest",
        "runtime_compat_version",
    ):
        other = dataclasses.replace(key, **{field: "x"})
        assert other != key and other not in {key}


def test_a_key_unpickled_in_another_process_finds_the_entry_of_an_equal_key():
    make = "AdapterKey('sha256:base', 'support', 'r2', 'sha256:bytes')"
    dump = (
        "import pickle, sys; from loraplex.residency.key import AdapterKey; "
        f"sys.stdout.buffer.write(pickle.dumps({make}))"
    )
    load = (
        "import pickle, sys; from loraplex.residency.key import AdapterKey; "
        f"print({{{make}: 'found'}}"
        "[pickle.loads(sys.stdin.buffer.read())])"
    )
    blob = subprocess.run(
        [sys.executable, "-c", dump],
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "1"},
    ).stdout
    # other str hashes: a kept hash would miss
    found = subprocess.run(
        [sys.executable, "-c", load],
        input=blob,
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "2"},
    )
    assert found.stdout.decode().strip() == "found"
