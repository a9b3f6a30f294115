"""Safetensors files as raw bytes per tensor: read, transposed, sliced by rows and written, in any
of the served dtypes, without torch."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraplex.lora_format import (
    DTYPE_BYTES,
    AdapterRejected,
    check_tiling,
    read_safetensors_header,
)


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes, row-major, and what they are."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def _array(self) -> np.ndarray:
        # the bytes as unsigned ints of the element's width: moving them needs no float dtype
        width = DTYPE_BYTES[self.dtype]
        return np.frombuffer(self.data, dtype=f"<u{width}").reshape(self.shape)

    def transposed(self) -> RawTensor:
        """A 2-D tensor's transpose: [a, b] -> [b, a]."""
        rows, cols = self.shape
        return RawTensor(self.dtype, (cols, rows), self._array().T.tobytes())

    def rows(self, start: int, stop: int) -> RawTensor:
        """Rows `start` to `stop` of a 2-D tensor."""
        return RawTensor(
            self.dtype, (stop - start, self.shape[1]), self._array()[start:stop].tobytes()
        )

    def taken(self, order: tuple[int, ...]) -> RawTensor:
        """The rows in `order`: row i is this tensor's row order[i]."""
        return RawTensor(self.dtype, self.shape, self._array()[list(order)].tobytes())

    def float32(self) -> np.ndarray:
        """The values as float32 (exact: every served dtype widens to it)."""
        bits = self._array()
        if self.dtype == "F32":
            return bits.view("<f4")
        if self.dtype == "F16":
            return bits.view("<f2").astype("<f4")
        return (bits.astype("<u4") << 16).view("<f4")  # bfloat16: float32's upper half


def assemble(shape: tuple[int, int], blocks: list[tuple[int, int, RawTensor, float]]) -> RawTensor:
    """A zero tensor of `shape` with each (row, column, block, scale) written in at its row and
    column, times its scale: in the blocks' dtype when they share one and no scale is 1 off, else in
    float32."""
    dtypes = {block.dtype for _, _, block, _ in blocks}
    if len(dtypes) == 1 and all(scale == 1.0 for *_, scale in blocks):
        dtype = dtypes.pop()
        out = np.zeros(shape, dtype=f"<u{DTYPE_BYTES[dtype]}")  # zero bits are 0.0 in each dtype
        for row, col, block, _ in blocks:
            out[row : row + block.shape[0], col : col + block.shape[1]] = block._array()
        return RawTensor(dtype, shape, out.tobytes())
    values = np.zeros(shape, dtype="<f4")
    for row, col, block, scale in blocks:
        part = block.float32().astype("<f8") * scale
        values[row : row + block.shape[0], col : col + block.shape[1]] = part
    return RawTensor("F32", shape, values.tobytes())


def read_tensors(path: Path) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """The tensors of a safetensors file and its metadata; AdapterRejected for a dtype that is not
    served or tensors that do not tile the file."""
    layout = read_safetensors_header(path)
    for key, info in layout.tensors.items():
        if info["dtype"] not in DTYPE_BYTES:
            raise AdapterRejected(
                "dtype", f"{key} has dtype {info['dtype']}; allowed: {', '.join(DTYPE_BYTES)}"
            )
    check_tiling(layout, path.name)
    data = path.read_bytes()[layout.data_start :]
    tensors = {
        key: RawTensor(info["dtype"], tuple(info["shape"]), data[slice(*info["data_offsets"])])
        for key, info in layout.tensors.items()
    }
    return tensors, _metadata(path)


def _metadata(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(length)).get("__metadata__") or {}
    return {str(k): str(v) for k, v in metadata.items()}


def write_tensors(path: Path, tensors: dict[str, RawTensor], metadata: dict[str, str]) -> None:
    """A safetensors file holding `tensors` in name order, as the safetensors library writes one
    (its header padded with spaces to a multiple of 8 bytes)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key in sorted(tensors):
        tensor = tensors[key]
        assert len(tensor.data) == math.prod(tensor.shape) * DTYPE_BYTES[tensor.dtype]
        header[key] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(tensor.data)],
        }
        offset += len(tensor.data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key in sorted(tensors):
            f.write(tensors[key].data)
