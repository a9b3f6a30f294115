"""The upload endpoint (`POST /admin/adapters/{name}/upload`) over a real server: a tar archive in
the body becomes a revision through the registration's checks, with the fast path of a trainer's
next version; bad uploads are refused in the OpenAI error shape and leave nothing behind."""

from __future__ import annotations

import io
import json
import re
import socket
import tarfile
from pathlib import Path

import httpx
import pytest
from harness import ADMIN_TOKEN, variant
from safetensors.torch import load_file, save_file

from loraplex.client import tar_stream
from loraplex.registry import AdapterNotFound

TAR = {"Content-Type": "application/x-tar", "Authorization": f"Bearer {ADMIN_TOKEN}"}


def archive(files: dict[str, bytes], gz: bool = False) -> bytes:
    members = [(name, len(data), iter([data])) for name, data in files.items()]
    raw = b"".join(tar_stream(members))
    if not gz:
        return raw
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=out, mode="w:gz") as tar,
        tarfile.open(fileobj=io.BytesIO(raw)) as src,
    ):
        for member in src:
            tar.addfile(member, src.extractfile(member))
    return out.getvalue()


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def upload(running, name: str, body: bytes, headers=TAR, **params) -> httpx.Response:
    return httpx.post(
        f"{running.url}/admin/adapters/{name}/upload",
        params={k: str(v).lower() if isinstance(v, bool) else v for k, v in params.items()},
        content=body,
        headers=headers,
        timeout=60,
    )


def leftovers(running) -> tuple[set[str], list[str], list[str]]:
    """The store's digests, its work directories and the name's revisions."""
    store = running.registry.store
    work = (
        sorted(p.name for p in (store.root / "tmp").iterdir())
        if (store.root / "tmp").is_dir()
        else []
    )
    try:
        revisions = [r.revision for r in running.registry.show("up").revisions]
    except AdapterNotFound:
        revisions = []
    return set(store.digests()), work, revisions


@pytest.fixture(scope="module")
def uploads(llama_adapters, tmp_path_factory):
    """Three versions of attn-r8 (same config, other bytes) and one with another config."""
    root = tmp_path_factory.mktemp("uploads")
    versions = [variant(llama_adapters["attn-r8"], root / f"v{i}", 1.0 + 0.1 * i) for i in range(3)]
    other = variant(llama_adapters["attn-r8"], root / "other", 1.5)
    config = json.loads((other / "adapter_config.json").read_text())
    config["lora_alpha"] = config["lora_alpha"] * 2
    (other / "adapter_config.json").write_text(json.dumps(config))
    return versions, other


def metric(running, name: str) -> float:
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match[1])


def test_upload_registers_a_revision_that_serves(running, uploads):
    versions, _ = uploads
    body = archive(files_of(versions[0]))
    sent = metric(running, "loraplex_adapter_published_bytes_total")
    timed = metric(running, "loraplex_adapter_publish_seconds_count")
    response = upload(running, "up", body, stable=True)
    assert response.status_code == 200, response.text
    assert metric(running, "loraplex_adapter_published_bytes_total") == sent + len(body)
    assert metric(running, "loraplex_adapter_publish_seconds_count") == timed + 1
    record = response.json()
    assert (
        record["name"] == "up" and record["status"] == "stable" and record["traffic_weight"] == 100
    )
    assert running.registry.store.has(record["digest"])
    answer = running.client().completions.with_raw_response.create(
        model="up", prompt="hi", max_tokens=2
    )
    assert answer.headers["x-loraplex-adapter"] == f"up@{record['revision']}"
    assert answer.headers["x-loraplex-adapter-digest"] == record["digest"]


def test_same_config_reuses_the_previous_revisions_checks(running, uploads):
    versions, other = uploads
    first = upload(running, "up", archive(files_of(versions[0])), stable=True).json()
    second = upload(running, "up", archive(files_of(versions[1]), gz=True), stable=True).json()
    assert second["revision"] != first["revision"]
    third = upload(running, "up", archive(files_of(other))).json()
    events = {
        e.target: e.detail for e in running.registry.audit_events(target="up") if e.action == "add"
    }
    assert events[f"up@{second['revision']}"]["checks_from"] == first["revision"]
    assert "checks_from" not in events[f"up@{third['revision']}"]  # another config: checked in full
    assert third["lora_alpha"] == 2 * second["lora_alpha"]
    # the figures the fast path records are those the full checks give
    for field in ("rank", "dtype", "target_modules", "estimated_bytes", "actual_bytes"):
        assert second[field] == first[field], field


def test_same_config_with_other_shapes_is_checked_in_full_and_refused(running, uploads, tmp_path):
    versions, _ = uploads
    upload(running, "up", archive(files_of(versions[0])), stable=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((versions[0] / "adapter_config.json").read_bytes())
    tensors = load_file(versions[0] / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()  # one input column short of the base's
    save_file(tensors, bad / "adapter_model.safetensors")
    before = leftovers(running)
    response = upload(running, "up", archive(files_of(bad)))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "shape"
    assert leftovers(running) == before


@pytest.mark.parametrize(
    "case, status, param",
    [
        ("pickle", 400, "weights"),
        ("not-tar", 400, "archive"),
        ("nested", 400, "archive"),
        ("readme", 400, "archive"),
        ("no-config", 400, "config"),
        ("json", 415, "content-type"),
        ("bad-name", 400, "name"),
        ("bad-keep", 400, "keep"),
        ("other-tenant", 400, "tenant"),  # refused once its bytes are stored: they are removed
    ],
)
def test_bad_uploads_are_refused_and_leave_nothing(running, uploads, case, status, param):
    versions, _ = uploads
    good = files_of(versions[2])
    bodies = {
        "pickle": archive({**good, "adapter_model.bin": b"\x80\x04."}),
        "not-tar": b"not a tar archive at all" * 100,
        "nested": archive({"adapter/" + k: v for k, v in good.items()}),
        "readme": archive({**good, "README.md": b"hello"}),
        "no-config": archive({"adapter_model.safetensors": good["adapter_model.safetensors"]}),
        "json": archive(good),
        "bad-name": archive(good),
        "bad-keep": archive(good),
        "other-tenant": archive(good),
    }
    headers = {**TAR, "Content-Type": "application/json"} if case == "json" else TAR
    name = {"bad-name": "bad name!", "other-tenant": "alice-a"}.get(case, "up")
    params = {"bad-keep": {"keep": 0}, "other-tenant": {"tenant": "bob"}}.get(case, {})
    before = leftovers(running)
    response = upload(running, name, bodies[case], headers=headers, **params)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    assert leftovers(running) == before


def test_upload_needs_the_admin_token_and_is_read_only_with_it(running, uploads):
    body = archive(files_of(uploads[0][0]))
    for token in (None, "wrong-token-0123456789"):
        headers = {"Content-Type": "application/x-tar"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        response = upload(running, "up-401", body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(AdapterNotFound):
        running.registry.show("up-401")


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(start, uploads):
    body = archive(files_of(uploads[0][0]))
    with start(max_upload_bytes=len(body) - 1) as running:
        before = leftovers(running)
        response = upload(running, "up", body)  # Content-Length says it
        assert response.status_code == 413, response.text
        streamed = httpx.post(  # chunked: counted as it arrives
            f"{running.url}/admin/adapters/up/upload",
            content=iter([body[:1000], body[1000:]]),
            headers=TAR,
            timeout=60,
        )
        assert streamed.status_code == 413, streamed.text
        assert streamed.json()["error"]["code"] == "request_too_large"
        assert leftovers(running) == before


def test_a_trainer_gone_mid_upload_leaves_nothing(running, uploads):
    """The connection closes halfway through the body: no revision, no store entry, no work
    directory."""
    body = archive(files_of(uploads[0][2]))
    host, port = running.url.removeprefix("http://").split(":")
    before = leftovers(running)
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /admin/adapters/gone/upload HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/x-tar\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[: len(body) // 2])
        running.wait_for(lambda: len(leftovers(running)[1]) > len(before[1]), what="the upload")
    running.wait_for(lambda: leftovers(running)[1] == before[1], what="the work directory to go")
    assert leftovers(running) == before
    with pytest.raises(AdapterNotFound):
        running.registry.show("gone")
