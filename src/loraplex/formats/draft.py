"""An adapter on its way to the canonical form: the canonical tensors as pieces of the source's
tensors, read from the headers alone and made only when the canonical form is written."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from loraplex.formats.tensors import RawTensor, assemble
from loraplex.lora_format import AdapterRejected


@dataclass(frozen=True)
class Piece:
    """How one canonical tensor is made from a tensor of the source file."""

    source: str
    transpose: bool = False
    rows: tuple[int, int] | None = None
    order: tuple[int, ...] | None = None  # row i is the source's row order[i] (before `rows`)

    def shape(self, header: dict) -> list[int]:
        shape = list(header[self.source]["shape"])
        if self.transpose:
            shape = shape[::-1]
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return shape

    def sliced(self, start: int, stop: int) -> Piece:
        """This piece's rows `start` to `stop`."""
        return replace(self, rows=(start, stop))

    def made(self, tensors: dict[str, RawTensor]) -> RawTensor:
        """The canonical tensor, from the source's tensors."""
        tensor = tensors[self.source]
        if self.transpose:
            tensor = tensor.transposed()
        if self.order is not None:
            tensor = tensor.taken(self.order)
        if self.rows is not None:
            tensor = tensor.rows(*self.rows)
        return tensor


class Block(NamedTuple):
    """A piece placed at (row, column) of a joined tensor, times its scale."""

    row: int
    column: int
    piece: Piece
    scale: float = 1.0


@dataclass(frozen=True)
class Joined:
    """A canonical tensor made of several source pieces: a zero tensor of `size` with each block
    written in (the split parts of a fused module: their A's stacked, their B's on a diagonal)."""

    size: tuple[int, int]
    blocks: tuple[Block, ...]

    @property
    def source(self) -> str:
        return " + ".join(b.piece.source for b in self.blocks)

    def shape(self, header: dict) -> list[int]:
        return list(self.size)

    def made(self, tensors: dict[str, RawTensor]) -> RawTensor:
        return assemble(
            self.size, [(b.row, b.column, b.piece.made(tensors), b.scale) for b in self.blocks]
        )


@dataclass
class Draft:
    """An adapter on its way to the canonical form: what the source is and what changes."""

    source_format: str
    weights: Path  # the source's weights file
    header: dict  # its tensors: name -> {"dtype", "shape", "data_offsets"}
    config: dict  # the PEFT config of the canonical form
    pieces: dict[str, Piece | Joined]  # canonical key -> where its bytes come from
    changes: list[str] = field(default_factory=list)


def add_piece(pieces: dict[str, Piece | Joined], key: str, piece: Piece | Joined) -> None:
    """Add the canonical tensor `key`; AdapterRejected when two tensors of the source make it."""
    if key in pieces:
        raise AdapterRejected(
            "weights", f"{pieces[key].source} and {piece.source} both give the tensor {key}"
        )
    pieces[key] = piece
