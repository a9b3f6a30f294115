"""Validating an adapter from its directory or from its bytes in memory: the same spec, the same
refusals."""

import dataclasses
import json
import struct

import pytest

from loraplex.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRejected,
    adapter_from_files,
    read_adapter,
)
from loraplex.model_config import ModelConfig


def files_of(adapter_dir) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def with_header(weights: bytes, edit) -> bytes:
    """The same safetensors file with its JSON header edited (the data section is kept as it is)."""
    (length,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + length])
    edit({k: v for k, v in header.items() if k != "__metadata__"})
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + weights[8 + length :]


def _first_two(header):
    return [info for _, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"])][
        :2
    ]


BROKEN = {
    "garbage": (lambda w: b"\x00garbage", "implausible"),
    "header not JSON": (lambda w: struct.pack("<Q", 5) + b"hello", "not a safetensors file"),
    "short": (lambda w: w[:5], "too short"),
    "header past the end": (lambda w: struct.pack("<Q", 10_000) + b"{}", "runs past its end"),
    "header not an object": (lambda w: struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    "malformed entry": (
        lambda w: with_header(w, lambda h: next(iter(h.values())).update(shape="x")),
        "malformed header entry",
    ),
    "offsets past the end": (
        lambda w: with_header(w, lambda h: _first_two(h)[0]["data_offsets"].__setitem__(1, 10**9)),
        "data_offsets",
    ),
    "overlapping tensors": (
        lambda w: with_header(
            w, lambda h: _first_two(h)[1].update(data_offsets=_first_two(h)[0]["data_offsets"])
        ),
        "data_offsets",
    ),
    "trailing bytes": (lambda w: w + b"\0" * 8, "data section"),
}


def test_bytes_in_memory_give_the_spec_the_directory_gives(llama_dir, llama_adapters):
    cfg = ModelConfig.from_dir(llama_dir)
    for path in llama_adapters.values():
        from_dir = read_adapter(path, cfg, 16)
        assert adapter_from_files(files_of(path), cfg, 16) == dataclasses.replace(
            from_dir, path=None
        )


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_safetensors_file_is_refused_from_disk_and_from_memory(
    llama_dir, llama_adapters, tmp_path, kind
):
    break_it, message = BROKEN[kind]
    cfg = ModelConfig.from_dir(llama_dir)
    files = files_of(llama_adapters["attn-r8"])
    files[WEIGHTS_FILE] = break_it(files[WEIGHTS_FILE])
    with pytest.raises(AdapterRejected, match=message):
        adapter_from_files(files, cfg, 16)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(AdapterRejected, match=message):
        read_adapter(tmp_path, cfg, 16)


@pytest.mark.parametrize("missing, field", [(WEIGHTS_FILE, "weights"), (CONFIG_FILE, "config")])
def test_files_in_memory_without_weights_or_config_are_refused(
    llama_dir, llama_adapters, missing, field
):
    files = files_of(llama_adapters["attn-r8"])
    del files[missing]
    with pytest.raises(AdapterRejected, match=f"missing {missing}") as refused:
        adapter_from_files(files, ModelConfig.from_dir(llama_dir), 16)
    assert refused.value.field == field


@pytest.mark.parametrize(
    "change, field",
    [
        ({"lora_alpha": "16"}, "lora_alpha"),
        ({"r": None}, "r"),
        ({"rank_pattern": ["q_proj"]}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": "8"}}, "alpha_pattern"),
        ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern"),
        # Not finite: every logit of the adapter's requests is NaN (json.dumps writes Infinity and
        # NaN, as a file may).
        ({"lora_alpha": float("inf")}, "lora_alpha"),
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"alpha_pattern": {"q_proj": float("-inf")}}, "alpha_pattern"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_naming_the_field(
    llama_dir, llama_adapters, change, field
):
    """Not a TypeError, AttributeError or re.error from deep inside (a 500, or a traceback at
    start-up)."""
    cfg = ModelConfig.from_dir(llama_dir)
    files = files_of(llama_adapters["attn-r8"])
    files[CONFIG_FILE] = json.dumps({**json.loads(files[CONFIG_FILE]), **change}).encode()
    with pytest.raises(AdapterRejected) as refused:
        adapter_from_files(files, cfg, 16)
    assert refused.value.field == field
