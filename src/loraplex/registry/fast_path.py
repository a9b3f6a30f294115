"""The publishing fast path: a new revision whose config and tensor table are those of its name's
previous revision takes that revision's checks (its import, its base model's identification), as a
trainer publishing one policy version after another makes them.

The new bytes are still read: their safetensors header is parsed and its tiling checked, their
digest computed and any signature verified; only what the config and the tensors' names, dtypes and
shapes decide is taken from the previous revision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from loraplex.artifacts import ArtifactStore, artifact_files
from loraplex.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRejected,
    AdapterSpec,
    SafetensorsLayout,
    check_tiling,
    read_safetensors_header,
)
from loraplex.registry.db import Revision
from loraplex.registry.store import Store

SIGNATURE_FILE = "adapter.sig"


@dataclass(frozen=True)
class Figures:
    """What a revision's row records of its adapter's spec (`AdapterSpec`)."""

    rank: int
    lora_alpha: float
    dtype: str
    target_modules: tuple[str, ...]
    estimated_bytes: int
    actual_bytes: int
    task_type: str | None

    @classmethod
    def of(cls, spec: AdapterSpec) -> Figures:
        return cls(
            spec.rank,
            spec.lora_alpha,
            spec.dtype,
            spec.target_modules,
            spec.estimated_bytes,
            spec.actual_bytes,
            spec.task_type,
        )


@dataclass(frozen=True)
class Previous:
    """The revision whose checks a new one reuses, and what they established."""

    revision: str
    base_model: str
    figures: Figures


def previous_revision(store: Store, name: str) -> Revision | None:
    """The newest revision of `name` that is neither retired nor quarantined (its row, detached)."""
    with store.read() as session:
        row = session.scalars(
            select(Revision)
            .where(
                Revision.adapter_name == name,
                Revision.status.not_in(("quarantined", "retired")),
            )
            .order_by(Revision.id.desc())
            .limit(1)
        ).first()
        if row is not None:
            session.expunge(row)
        return row


def checks_to_reuse(
    store: Store, artifacts: ArtifactStore, name: str, src: Path, base: tuple[str, str]
) -> Previous | None:
    """The previous revision of `name` when `src` has its config and tensor table and `base`
    (the base model's name and digest) is its base model; None when the full checks run. The new
    header's tiling is checked here."""
    row = previous_revision(store, name)
    if row is None or (row.base_model, row.base_model_digest) != base:
        return None
    if not artifacts.has(row.digest):
        return None
    stored = artifacts.path(row.digest)
    names = [n for n in artifact_files(src) if n != SIGNATURE_FILE]
    if names != [CONFIG_FILE, WEIGHTS_FILE] or artifact_files(stored) != names:
        return None
    config = _config(src)
    if config != _config(stored):
        return None
    layout = read_safetensors_header(src / WEIGHTS_FILE)
    if _table(layout) != _table(read_safetensors_header(stored / WEIGHTS_FILE)):
        return None
    check_tiling(layout, WEIGHTS_FILE)
    figures = Figures(
        row.rank,
        row.lora_alpha,
        row.dtype,
        tuple(row.target_modules.split(",")),
        row.estimated_bytes,
        row.actual_bytes,
        config.get("task_type"),
    )
    return Previous(row.revision, row.base_model, figures)


def _config(directory: Path) -> dict:
    try:
        config = json.loads((directory / CONFIG_FILE).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRejected("config", f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterRejected("config", f"{CONFIG_FILE} must hold a JSON object")
    return config


def _table(layout: SafetensorsLayout) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape (not its offsets: those are checked by the tiling)."""
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in layout.tensors.items()}
