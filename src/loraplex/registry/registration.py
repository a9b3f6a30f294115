"""Registration: validate an adapter directory, store its bytes, record the revision."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.artifacts import (
    AllowList,
    ArtifactStore,
    artifact_files,
    canonical_digest,
    is_oci_uri,
    push_artifact,
)
from loraplex.artifacts.s3 import is_s3_uri, push_s3
from loraplex.formats import ImportRecord, imported_adapter
from loraplex.lora_format import (
    CONFIG_FILE,
    AdapterSpec,
    base_model_mismatch,
    quantised_base,
    read_adapter,
)
from loraplex.model_config import ModelConfig, ModelConfigError, base_model_digest
from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    ArtifactPieces,
    ArtifactPiecesBlake3,
    Revision,
    Tenant,
    utcnow,
)
from loraplex.registry.errors import (
    AdapterRejected,
    RegistryError,
)
from loraplex.registry.fast_path import Figures, Previous, checks_to_reuse
from loraplex.registry.records import (
    NAME_RE,
    REVISION_RE,
    WARM_POLICIES,
    RevisionRecord,
    read_revision_record,
)
from loraplex.registry.release import parse_eval_set
from loraplex.registry.retention import (
    check_keep,
    delete_artifact,
    pushed_left,
    retire_beyond_keep,
)
from loraplex.registry.signing import read_signature_file, verify_digest
from loraplex.registry.store import Store

log = logging.getLogger("loraplex.registry")


@dataclass(frozen=True)
class Stored:
    """An adapter directory checked and in the store (in its canonical form), not yet recorded."""

    src: Path
    model: ModelConfig  # the base model it was imported for
    imported: ImportRecord | None  # None: the source was canonical already
    digest: str
    spec: Figures
    base_model: str
    base_model_digest: str
    eval_set: str | None
    signature: str | None
    pieces: str  # BLAKE3 piece list, JSON
    sha256_pieces: str
    storage_uri: str
    checks_from: str | None = None
    """The revision whose checks this one reused (`fast_path`); None: checked in full."""


STORAGE_SCHEMES = ("oci", "oci+http", "http", "https", "s3", "file")
"""The schemes of a storage base: an OCI repository or an S3 prefix revisions are uploaded to, or
where the store's `sha256/` directory is served or copied."""


def check_storage_base(base: str) -> str:
    """`base`, or RegistryError naming the supported schemes."""
    scheme, sep, rest = base.partition("://")
    if not sep or scheme not in STORAGE_SCHEMES or not rest.strip("/"):
        raise RegistryError(
            f"storage base {base!r}: give oci://HOST/REPOSITORY (oci+http:// for plain http) or "
            "s3://BUCKET/PREFIX, which revisions are uploaded to, or an http://, https:// or "
            "file:// URL the store's sha256/ directory is at"
        )
    return base


class Registration:
    """Adding revisions, and collecting the store entries no revision refers to."""

    def __init__(
        self,
        store: Store,
        *,
        base_model_dir: str | Path | None = None,
        max_lora_rank: int = 64,
        trusted_keys: tuple = (),
        allowed: AllowList | None = None,
        storage_base: str | None = None,
        strict_base_model_name: bool = False,
        unreachable_store: str | None = None,
    ):
        """`storage_base`: URL under which the store's `<hex>` directories are served, an S3
        prefix (`s3://BUCKET/PREFIX`) they are uploaded to, or an OCI repository
        (`oci://HOST/REPOSITORY`) each revision's bytes are pushed to (else file:// URIs).

        `allowed`: when set, `add_revision` only reads adapter directories under its roots.
        `trusted_keys`: ed25519 public keys; when set, unsigned or badly signed revisions are
        refused. `strict_base_model_name`: refuse an adapter whose config names another base model
        (by default a warning: its shapes are checked against the base model either way).
        `unreachable_store`: why the workers could not read what this registration would store
        (`store.unreachable_store`); when given, every registration is refused with it.
        """
        self.store = store
        self.base_model_dir = Path(base_model_dir) if base_model_dir else None
        self.max_lora_rank = max_lora_rank
        self.strict_base_model_name = strict_base_model_name
        self.trusted_keys = tuple(trusted_keys)
        self.allowed = allowed
        self.storage_base = check_storage_base(storage_base).rstrip("/") if storage_base else None
        self.unreachable_store = unreachable_store

    def add_revision(
        self,
        src_dir: str | Path,
        name: str,
        revision: str | None = None,
        tenant: str | None = None,
        shared: bool | None = None,
        base_model_dir: str | Path | None = None,
        warm_policy: str | None = None,
        priority: int | None = None,
        status: str = "staging",
        eval_set: str | Path | None = None,
        signature: str | None = None,
        digest: str | None = None,
        base_model: str | None = None,
        keep: int | None = None,
        fast_path: bool = False,
    ) -> RevisionRecord:
        """Validate an adapter directory, put it into the store and record it, in one transaction.

        `tenant` owns the adapter (None: shared by all); `shared=True` with a tenant makes an owned
        adapter usable by all. `digest`: refuse unless the files hash to it. `status`: "staging" (no
        traffic yet) or "stable" (100% of the name's traffic at once, as `serve --lora-modules`
        does). `keep`: the name keeps its newest `keep` revisions servable from now on (None: as it
        was; `retention`). `fast_path`: reuse the checks of the name's previous revision when
        the adapter has its config and tensor table (`fast_path.checks_to_reuse`). Registering the
        same bytes again under the same name returns the existing revision (a retired one's bytes
        make a new revision).
        """
        check_names(name, revision, warm_policy, status)
        check_keep(keep)
        stored = self.check_and_store(
            Path(src_dir),
            base_model_dir,
            base_model,
            eval_set,
            digest,
            signature,
            reuse_from=name if fast_path and eval_set is None else None,
        )
        try:
            with self.store.write() as session:
                adapter = self.adapter_for_add(
                    session,
                    name,
                    tenant,
                    shared,
                    stored.spec.task_type,
                    warm_policy,
                    priority,
                    keep,
                )
                record = self.insert_revision(session, adapter, stored, revision, status)
                if keep is not None:
                    retire_beyond_keep(self.store, session, adapter)
                return record
        except AdapterRejected:
            self.drop_unrecorded(stored.digest)
            raise

    def drop_unrecorded(self, digest: str) -> None:
        """Remove stored bytes that no revision records (a registration refused after storing
        them), under the write lock: a registration of the same bytes committing later puts them
        back (`put_again`)."""
        with self.store.write() as session:
            if session.scalar(select(Revision.id).where(Revision.digest == digest).limit(1)):
                return
            self._artifacts().remove(digest)

    def check_and_store(
        self,
        src: Path,
        base_model_dir,
        base_model,
        eval_set,
        digest,
        signature,
        reuse_from: str | None = None,
    ) -> Stored:
        """Check an adapter directory (allowed root, shapes, eval set, digest, signature) and put
        its bytes into the store; AdapterRejected naming the field otherwise. `reuse_from`: a name
        whose previous revision's checks hold when the adapter has its config and tensors."""
        if self.unreachable_store is not None:
            raise RegistryError(self.unreachable_store)
        if self.allowed is not None:
            self._check_source_allowed(src)
        model, base_name, base_digest = self._base_model(src, base_model_dir, base_model)
        if reuse_from is not None:
            base = (base_name, base_digest)
            previous = checks_to_reuse(self.store, self._artifacts(), reuse_from, src, base)
            if previous is not None:
                return self._store_checked(src, model, previous, base_digest, digest, signature)
        with imported_adapter(src, model) as adapter:
            spec = self._validate(adapter.path, model, base_name, src)
            cases_text = Path(eval_set).read_text() if eval_set is not None else None
            if cases_text is not None:
                parse_eval_set(cases_text)
            actual = canonical_digest(adapter.path)
            source = actual if adapter.record is None else adapter.record.source_digest
            if digest is not None and digest not in (source, actual):
                raise AdapterRejected(
                    "digest", f"the files hash to {source}, not to the expected {digest}"
                )
            # over what is stored and served: an imported adapter's canonical form
            signature, pieces, sha256_pieces = self._signed_and_stored(
                src, adapter.path, actual, signature
            )
        return Stored(
            src,
            model,
            adapter.record,
            actual,
            Figures.of(spec),
            base_name,
            base_digest,
            cases_text,
            signature,
            pieces.to_json(),
            sha256_pieces.to_json(),
            self.publish(actual),
        )

    def _signed_and_stored(self, src: Path, files: Path, actual: str, signature: str | None):
        """The signature checked against the trusted keys (read beside `src` when not given) and
        `files` put into the store, from the read that hashes the copy: (signature, its piece
        lists); AdapterRejected when the files changed since `actual` was taken."""
        if signature is None:
            signature = read_signature_file(src)
        if self.trusted_keys:
            verify_digest(actual, signature, self.trusted_keys)
        put, (pieces, sha256_pieces) = self._artifacts().put_with_piece_lists(files)
        if put != actual:
            raise AdapterRejected(
                "digest", f"the files in {src} changed while they were being registered"
            )
        return signature, pieces, sha256_pieces

    def _store_checked(
        self, src: Path, model: ModelConfig, previous: Previous, base_digest, digest, signature
    ) -> Stored:
        """`check_and_store` of a canonical adapter that the checks of `previous` cover: its
        digest, signature and store entry."""
        actual = canonical_digest(src)
        if digest is not None and digest != actual:
            raise AdapterRejected(
                "digest", f"the files hash to {actual}, not to the expected {digest}"
            )
        signature, pieces, sha256_pieces = self._signed_and_stored(src, src, actual, signature)
        return Stored(
            src,
            model,
            None,
            actual,
            previous.figures,
            previous.base_model,
            base_digest,
            None,
            signature,
            pieces.to_json(),
            sha256_pieces.to_json(),
            self.publish(actual),
            checks_from=previous.revision,
        )

    def insert_revision(
        self, session: Session, adapter: Adapter, stored: Stored, revision: str | None, status: str
    ) -> RevisionRecord:
        """Record stored bytes as a revision of `adapter`, inside the caller's write transaction;
        the same bytes under the same name give the existing revision."""
        actual, spec, name = stored.digest, stored.spec, adapter.name
        self.put_again(stored)
        # Both lists, also for bytes registered before the tables: the BLAKE3 one this version
        # checks, and the sha256 one earlier versions read (they refuse another hash), for servers
        # of both sharing a registry.
        if session.get(ArtifactPiecesBlake3, actual) is None:
            session.add(ArtifactPiecesBlake3(digest=actual, pieces=stored.pieces))
        if session.get(ArtifactPieces, actual) is None:
            session.add(ArtifactPieces(digest=actual, pieces=stored.sha256_pieces))
        existing = q.find_revision(session, name, revision, actual)
        if existing is not None and existing.status == "retired":
            raise AdapterRejected(
                "revision",
                f"{name}@{revision} is retired and its label is not used again; register these "
                "bytes under a new revision",
            )
        if existing is not None:
            return read_revision_record(session, adapter, existing)
        row = Revision(
            adapter_name=name,
            revision=revision or q.next_revision(session, name),
            digest=actual,
            base_model=stored.base_model,
            base_model_digest=stored.base_model_digest,
            rank=spec.rank,
            lora_alpha=spec.lora_alpha,
            dtype=spec.dtype,
            target_modules=",".join(spec.target_modules),
            estimated_bytes=spec.estimated_bytes,
            actual_bytes=spec.actual_bytes,
            storage_uri=stored.storage_uri,
            signature=stored.signature,
            eval_set=stored.eval_set,
            status="staging",
            created_at=utcnow(),
        )
        session.add(row)
        session.flush()
        self.store.audit(
            session,
            "add",
            f"{name}@{row.revision}",
            digest=actual,
            status=status,
            owner=adapter.owner_tenant,
            shared=adapter.shared,
            estimated_bytes=spec.estimated_bytes,
            **({"keep": adapter.keep} if adapter.keep is not None else {}),
            **({"imported": stored.imported.as_dict()} if stored.imported else {}),
            **({"checks_from": stored.checks_from} if stored.checks_from else {}),
        )
        if status == "stable":
            q.apply_traffic(session, name, {row.revision: 100}, stable=row.revision)
            retire_beyond_keep(self.store, session, adapter)
        return read_revision_record(session, adapter, row)

    def put_again(self, stored: Stored) -> None:
        """Put the bytes back when a gc or a retirement deleted them since they were stored (and
        push them again: a retirement deletes the pushed copy after the local one)."""
        artifacts = self._artifacts()
        if artifacts.has(stored.digest):
            return
        with imported_adapter(stored.src, stored.model) as adapter:
            if artifacts.put(adapter.path) != stored.digest:
                raise AdapterRejected(
                    "digest", f"the files in {stored.src} changed while they were being registered"
                )
        if is_oci_uri(stored.storage_uri) or is_s3_uri(stored.storage_uri):
            self.publish(stored.digest)  # the same manifest or key, so the same storage URI

    def _artifacts(self) -> ArtifactStore:
        if self.store.artifacts is None:
            raise RegistryError(
                "no artifact store configured for this registry (pass store=ArtifactStore(DIR))"
            )
        return self.store.artifacts

    def _check_source_allowed(self, src: Path) -> None:
        root = self.allowed.root_for(src.resolve().as_uri())
        for name in artifact_files(src):
            if not (src / name).resolve().is_relative_to(root):
                raise AdapterRejected(
                    "path", f"{src / name} is a symlink out of the allowed root {root}"
                )

    def _base_model(self, src: Path, base_model_dir, base_model: str | None):
        """(ModelConfig, base model name, base model digest), or AdapterRejected naming the
        base model."""
        base_dir = (
            Path(base_model_dir)
            if base_model_dir
            else self.base_model_dir or _base_dir_named_by(src)
        )
        if base_dir is None:
            raise AdapterRejected(
                "base_model", "no base model to validate against: pass --base-model DIR"
            )
        try:
            model = ModelConfig.from_dir(base_dir)
        except (ModelConfigError, OSError, ValueError) as exc:
            raise AdapterRejected("base_model", f"{base_dir}: {exc}") from None
        return model, base_model or base_dir.resolve().name, base_model_digest(base_dir)

    def _validate(
        self, adapter_dir: Path, model: ModelConfig, base_name: str, src: Path
    ) -> AdapterSpec:
        """The canonical adapter's spec, or AdapterRejected naming field and reason."""
        spec = read_adapter(adapter_dir, model, self.max_lora_rank)
        mismatch = base_model_mismatch(spec, base_name)
        if mismatch and self.strict_base_model_name:
            raise AdapterRejected("base_model_name_or_path", mismatch)
        if mismatch:
            log.warning(
                "%s: %s; accepted, as its shapes fit (--strict-base-model-name refuses it)",
                src,
                mismatch,
            )
        if note := quantised_base(spec):
            log.warning("%s: %s; accepted", src, note)
        return spec

    def adapter_for_add(
        self, session, name, tenant, shared, task_type, warm_policy, priority, keep=None
    ) -> Adapter:
        if tenant is not None and session.get(Tenant, tenant) is None:
            raise AdapterRejected(
                "tenant",
                f"unknown tenant {tenant!r}; add it with `loraplex registry tenant add {tenant}`",
            )
        adapter = q.locked_adapter(session, name)
        if adapter is None:
            adapter = Adapter(
                name=name,
                owner_tenant=tenant,
                shared=tenant is None if shared is None else shared,
                task_type=task_type,
                priority=priority or 0,
                warm_policy=warm_policy or "on_demand",
                pinned=False,
                created_at=utcnow(),
                keep=keep,
            )
            session.add(adapter)
            session.flush()
            return adapter
        if tenant is not None and tenant != adapter.owner_tenant:
            raise AdapterRejected(
                "tenant", f"{name} is not owned by tenant {tenant!r}; pick another name"
            )
        if shared is not None:
            adapter.shared = shared
        if warm_policy is not None:
            adapter.warm_policy = warm_policy
        if priority is not None:
            adapter.priority = priority
        if keep is not None:
            adapter.keep = keep
        return adapter

    def publish(self, digest: str) -> str:
        """The storage URI of stored bytes; for an OCI or S3 base, once they are uploaded there
        (outside any transaction: an upload takes as long as its bytes)."""
        if self.storage_base and is_oci_uri(self.storage_base):
            return push_artifact(self._artifacts().path(digest), digest, self.storage_base)
        if self.storage_base and is_s3_uri(self.storage_base):
            return push_s3(self._artifacts().path(digest), digest, self.storage_base)
        return self.storage_uri(digest)

    def storage_uri(self, digest: str) -> str:
        if self.storage_base and is_oci_uri(self.storage_base):
            raise RegistryError("an OCI storage URI names a manifest: `publish` pushes it")
        if self.storage_base:
            return f"{self.storage_base}/{digest.removeprefix('sha256:')}"
        return self._artifacts().uri(digest)

    def gc_artifacts(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove the store entries of retired revisions that no other revision refers to, with
        the pushed copies (OCI, S3) that their retirement could not delete, and the entries no
        revision refers to once older than `min_age_s` (left by refused or interrupted
        registrations; the age keeps a registration in flight from losing its bytes). Returns
        the digests removed, locally or from where they were pushed."""
        # Under the write lock: a registration commits its row before this reads the digests in use,
        # or after the removals, and then finds its artifact gone and puts it back (add_revision).
        artifacts = self._artifacts()
        with self.store.write() as session:
            used: set[str] = set()
            retired: set[str] = set()
            for digest, status in session.execute(select(Revision.digest, Revision.status)):
                (retired if status == "retired" else used).add(digest)
            cutoff = time.time() - min_age_s
            removed = [
                d
                for d in artifacts.digests()
                if d not in used and (d in retired or artifacts.path(d).stat().st_mtime < cutoff)
            ]
            for digest in removed:
                artifacts.remove(digest)
            if removed:
                self.store.audit(session, "gc", "artifacts", removed=removed)
            for digest, uri in pushed_left(session, used).items():
                if delete_artifact(self.store, session, digest, uri) and digest not in removed:
                    removed.append(digest)
        return removed


def check_names(name: str, revision: str | None, warm_policy: str | None, status: str) -> None:
    if not NAME_RE.fullmatch(name):
        raise AdapterRejected("name", f"{name!r} must match {NAME_RE.pattern}")
    if revision is not None and not REVISION_RE.fullmatch(revision):
        raise AdapterRejected("revision", f"{revision!r} must match {REVISION_RE.pattern}")
    if warm_policy is not None and warm_policy not in WARM_POLICIES:
        raise AdapterRejected(
            "warm_policy", f"{warm_policy!r} is not one of {', '.join(WARM_POLICIES)}"
        )
    if status not in ("staging", "stable"):
        raise AdapterRejected(
            "status", f"a new revision starts as staging or stable, not {status!r}"
        )


def _base_dir_named_by(src: Path) -> Path | None:
    """The base model directory the adapter's config names, when it is a local directory."""
    try:
        named = json.loads((src / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(named) if named else None
    return path if path is not None and (path / "config.json").is_file() else None
