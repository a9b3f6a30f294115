"""Adapters imported into one canonical form: PEFT's `adapter_config.json` and
`adapter_model.safetensors`, keys `base_model.model.….lora_A.weight` (A [r, in], B [out, r]), on the
base model's own module layout. Every conversion is recorded inside the canonical weights file."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loraplex.artifacts.digests import canonical_digest
from loraplex.formats.base_copies import drop_base_copies
from loraplex.formats.draft import Draft
from loraplex.formats.fused import split_fused
from loraplex.formats.sources import read_draft
from loraplex.formats.stacked import fuse_split
from loraplex.formats.tensors import read_tensors, write_tensors
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.model_config import ModelConfig

IMPORT_METADATA_KEY = "loraplex_import"


@dataclass(frozen=True)
class ImportRecord:
    """What an import changed: kept in the canonical weights file's safetensors metadata."""

    source_format: str  # "peft", "mlx-lm", "torchtune", "nemo"
    source_digest: str  # the source directory's canonical_digest
    changes: tuple[str, ...]

    def as_dict(self) -> dict:
        return {
            "source_format": self.source_format,
            "source_digest": self.source_digest,
            "changes": list(self.changes),
        }


@dataclass(frozen=True)
class Imported:
    """The canonical adapter: `path` is the source itself when it was canonical already (`record`
    None), else the directory the import wrote."""

    path: Path
    record: ImportRecord | None


def import_adapter(src: str | Path, model: ModelConfig, out: Path) -> Imported:
    """The adapter in `src` in the canonical form, written into the empty directory `out` when it
    differs from the source; AdapterRejected for a format or content that cannot be imported."""
    src = Path(src)
    draft = drop_base_copies(fuse_split(split_fused(read_draft(src, model), model), model), model)
    if not draft.changes:
        return Imported(src, None)
    record = ImportRecord(draft.source_format, canonical_digest(src), tuple(draft.changes))
    _write(draft, record, out)
    return Imported(out, record)


@contextlib.contextmanager
def imported_adapter(src: str | Path, model: ModelConfig) -> Iterator[Imported]:
    """`import_adapter` into a temporary directory that lasts as long as the `with` block."""
    with tempfile.TemporaryDirectory(prefix="loraplex-import-") as work:
        yield import_adapter(src, model, Path(work) / "adapter")


def read_import_record(adapter_dir: str | Path) -> ImportRecord | None:
    """The record of the import that made a canonical adapter; None for one imported unchanged."""
    _, metadata = read_tensors(Path(adapter_dir) / WEIGHTS_FILE)
    raw = metadata.get(IMPORT_METADATA_KEY)
    if raw is None:
        return None
    data = json.loads(raw)
    return ImportRecord(data["source_format"], data["source_digest"], tuple(data["changes"]))


def _write(draft: Draft, record: ImportRecord, out: Path) -> None:
    source, metadata = read_tensors(draft.weights)
    tensors = {key: piece.made(source) for key, piece in draft.pieces.items()}
    metadata = {**metadata, "format": "pt", IMPORT_METADATA_KEY: json.dumps(record.as_dict())}
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(out / WEIGHTS_FILE, tensors, metadata)
    (out / CONFIG_FILE).write_text(json.dumps(draft.config, indent=2, sort_keys=True))


__all__ = [
    "IMPORT_METADATA_KEY",
    "ImportRecord",
    "Imported",
    "import_adapter",
    "imported_adapter",
    "read_import_record",
]
