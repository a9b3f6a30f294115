"""The OCI store against a real registry (Debian's docker-registry, the CNCF distribution registry):
push and pull by digest, tampered blobs and manifests refused, logins from a docker config file."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from loraplex.artifacts import (
    AllowList,
    ArtifactStore,
    ArtifactUnavailable,
    DigestMismatch,
    RegistryAuth,
    UnsafeLocation,
    canonical_digest,
    fetch_and_read,
    fetch_artifact,
    push_artifact,
)
from loraplex.artifacts.oci import (
    ARTIFACT_TYPE,
    Layer,
    OciRef,
    build_manifest,
    file_sha256,
    parse_layers,
)

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
pytestmark = pytest.mark.skipif(
    not Path(REGISTRY_BIN).exists(),
    reason="needs Debian's docker-registry (apt-get install docker-registry; CI installs it)",
)
USER, PASSWORD = "ci", "s3cret-pass"


def fake_adapter(path: Path, payload: bytes = b"weights") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "adapter_model.safetensors").write_bytes(payload)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def htpasswd(root: Path) -> dict:
    """The registry's `auth` section for basic logins from an htpasswd file (bcrypt only)."""
    import bcrypt

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (root / "htpasswd").write_text(f"{USER}:{hashed}\n")
    return {"htpasswd": {"realm": "loraplex-test", "path": str(root / "htpasswd")}}


class Registry:
    """A distribution registry process on a loopback port."""

    def __init__(self, root: Path, auth: dict):
        self.root, self.port = root, free_port()
        self.storage = root / "storage"
        config = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},  # manifests of retired revisions are deleted
            },
            "http": {"addr": f"127.0.0.1:{self.port}"},
            "auth": auth,
        }
        (root / "config.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = (root / "registry.log").open("wb")
        self.process = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(root / "config.yml")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait_ready()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def base(self, repository: str = "loras/team-a") -> str:
        return f"oci+http://{self.host}/{repository}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self.log.name}")
            try:
                if httpx.get(f"http://{self.host}/v2/").status_code in (200, 401):
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("docker-registry did not answer /v2/ within 30 s")

    def blob_file(self, digest: str) -> Path:
        hex_ = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("oci-registry")
    server = Registry(root, htpasswd(root))
    yield server
    server.stop()


@pytest.fixture()
def login(registry, tmp_path) -> RegistryAuth:
    """A docker config file as a `kubernetes.io/dockerconfigjson` Secret mounts it."""
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    path = tmp_path / ".dockerconfigjson"
    path.write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    return RegistryAuth.from_file(path)


def test_round_trip_by_digest(registry, login, tmp_path):
    src = fake_adapter(tmp_path / "a", b"w" * 3000)
    digest = canonical_digest(src)
    uri = push_artifact(src, digest, registry.base(), login)
    ref = OciRef.parse(uri)
    assert uri.startswith(registry.base() + "@sha256:") and ref.digest is not None
    # the URI names the manifest, whose bytes hash to it and list each file by its sha256
    manifest = httpx.get(
        f"http://{registry.host}/v2/loras/team-a/manifests/{ref.digest}",
        auth=(USER, PASSWORD),
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    ).content
    assert "sha256:" + hashlib.sha256(manifest).hexdigest() == ref.digest
    assert json.loads(manifest)["artifactType"] == ARTIFACT_TYPE
    layers = {layer.name: layer.digest for layer in parse_layers(manifest, uri)}
    assert layers == {
        name: "sha256:" + hashlib.sha256((src / name).read_bytes()).hexdigest()
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    # the same files push to the same manifest
    assert push_artifact(src, digest, registry.base(), login) == uri

    dest = ArtifactStore(tmp_path / "worker")
    path = fetch_artifact(uri, digest, dest, AllowList.parse([registry.base()]), oci_auth=login)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / name).read_bytes() == (src / name).read_bytes()
    assert canonical_digest(path) == digest


def test_a_tampered_blob_is_refused_and_nothing_is_kept(registry, login, tmp_path):
    src = fake_adapter(tmp_path / "a", b"tamper me " * 100)
    digest = canonical_digest(src)
    uri = push_artifact(src, digest, registry.base("loras/tamper"), login)
    weights = (
        "sha256:" + hashlib.sha256((src / "adapter_model.safetensors").read_bytes()).hexdigest()
    )
    blob = registry.blob_file(weights)
    data = bytearray(blob.read_bytes())
    data[5] ^= 1
    blob.write_bytes(bytes(data))

    dest = ArtifactStore(tmp_path / "worker")
    used = []
    with pytest.raises(DigestMismatch) as refused:
        fetch_and_read(
            uri,
            digest,
            dest,
            AllowList.parse([registry.base("loras")]),
            lambda files, hashed: used.append(files),
            oci_auth=login,
        )
    assert refused.value.expected == weights
    assert used == [] and not dest.has(digest) and dest.digests() == []


def test_a_manifest_naming_other_blobs_is_refused(registry, login, tmp_path):
    """Each blob matches its own sha256, but the files are another adapter's."""
    good = fake_adapter(tmp_path / "good", b"good weights")
    other = fake_adapter(tmp_path / "other", b"other weights")
    digest = canonical_digest(good)
    base = registry.base("loras/swap")
    push_artifact(other, canonical_digest(other), base, login)
    push_artifact(good, digest, base, login)

    # a manifest that claims `digest` but lists the other adapter's blobs, pushed by a writer
    swapped = [
        Layer(name, file_sha256(other / name), (other / name).stat().st_size)
        for name in ("adapter_config.json", "adapter_model.safetensors")
    ]
    forged = build_manifest(swapped, digest)
    forged_digest = "sha256:" + hashlib.sha256(forged).hexdigest()
    put = httpx.put(
        f"http://{registry.host}/v2/loras/swap/manifests/{forged_digest}",
        content=forged,
        auth=(USER, PASSWORD),
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
    )
    assert put.status_code == 201

    dest = ArtifactStore(tmp_path / "worker")
    with pytest.raises(DigestMismatch):
        fetch_artifact(
            f"{base}@{forged_digest}", digest, dest, AllowList.parse([base]), oci_auth=login
        )
    assert dest.digests() == []


def test_logins_come_from_the_docker_config_file(registry, login, tmp_path):
    src = fake_adapter(tmp_path / "a", b"private")
    digest = canonical_digest(src)
    with pytest.raises(ArtifactUnavailable, match="401"):
        push_artifact(src, digest, registry.base(), RegistryAuth({}))
    uri = push_artifact(src, digest, registry.base(), login)
    allowed = AllowList.parse([registry.base()])
    with pytest.raises(ArtifactUnavailable, match="401"):
        fetch_artifact(
            uri, digest, ArtifactStore(tmp_path / "w1"), allowed, oci_auth=RegistryAuth({})
        )

    # the environment names the file (a mounted Secret); it is read at the fetch
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / ".dockerconfigjson").write_text(
        json.dumps({"auths": {f"http://{registry.host}": {"username": USER, "password": PASSWORD}}})
    )
    env = {"LORAPLEX_OCI_AUTH_FILE": str(secret / ".dockerconfigjson")}
    path = fetch_artifact(
        uri,
        digest,
        ArtifactStore(tmp_path / "w2"),
        allowed,
        oci_auth=RegistryAuth.from_environ(env),
    )
    assert canonical_digest(path) == digest


def test_auth_files_and_environment():
    with pytest.raises(ArtifactUnavailable, match="docker config"):
        RegistryAuth.from_file("/nonexistent/config.json")
    assert RegistryAuth.from_environ({"DOCKER_CONFIG": "/nonexistent"}).logins == {}


def test_storage_uris_name_a_manifest_by_digest(registry, tmp_path):
    digest = "sha256:" + "a" * 64
    assert OciRef.parse(f"oci://ghcr.io:443/org/loras@{digest}").api == (
        "https://ghcr.io:443/v2/org/loras"
    )
    with pytest.raises(UnsafeLocation, match="tags are refused"):
        OciRef.parse("oci://ghcr.io/org/loras:v1")
    for bad in (
        "oci://ghcr.io/Org/loras",  # not a repository name
        "oci://user:pw@ghcr.io/org/loras",
        f"oci://ghcr.io/org/../loras@{digest}",
        "oci://ghcr.io/org/loras@sha256:abc",
    ):
        with pytest.raises(UnsafeLocation):
            OciRef.parse(bad)
    allowed = AllowList.parse(["oci://ghcr.io/org"])
    allowed.check(f"oci://ghcr.io/org/loras@{digest}")
    for outside in (
        f"oci://ghcr.io/other/loras@{digest}",
        f"oci+http://ghcr.io/org/loras@{digest}",
        f"oci://evil.io/org/loras@{digest}",
    ):
        with pytest.raises(UnsafeLocation):
            allowed.check(outside)
    with pytest.raises(UnsafeLocation, match="by its digest"):
        fetch_artifact(
            registry.base(),
            digest,
            ArtifactStore(tmp_path / "worker"),
            AllowList.parse([registry.base()]),
            oci_auth=RegistryAuth({}),
        )


def test_registry_add_pushes_and_a_worker_pulls_by_digest(
    registry, adapter_v1, llama_dir, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from loraplex.registry.cli import app
    from loraplex.residency.disk import DiskTier

    secret = tmp_path / ".dockerconfigjson"
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    secret.write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    monkeypatch.setenv("LORAPLEX_OCI_AUTH_FILE", str(secret))
    base = registry.base("loras/cli")
    runner = CliRunner()

    def cli(*args):
        common = ["--data-dir", str(tmp_path / "data"), "--storage-base", base]
        result = runner.invoke(app, [*common, *map(str, args)])
        assert result.exit_code == 0, (result.output, result.exception)
        return result.stdout

    cli("init")
    added = json.loads(
        cli("add", adapter_v1, "--name", "chat", "--base-model", llama_dir, "--json")
    )
    digest = canonical_digest(adapter_v1)
    assert added["digest"] == digest
    assert added["storage_uri"].startswith(base + "@sha256:")

    disk = DiskTier(tmp_path / "worker", 1 << 30, AllowList.parse([registry.base("loras")]))
    try:
        files, download_s = disk.read(added["storage_uri"], digest, use=lambda f, hashed: f)
    finally:
        disk.close()
    assert download_s is not None
    assert (
        bytes(files["adapter_model.safetensors"])
        == (adapter_v1 / "adapter_model.safetensors").read_bytes()
    )


def _login_file(path: Path, host: str, password: str) -> Path:
    auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def _pushing_registry(registry, llama_dir, tmp_path, repo: str):
    """A registry pushing to `repo` of the OCI registry, and how a manifest of it answers."""
    from loraplex.registry import Registry

    reg = Registry(
        f"sqlite:///{tmp_path / 'registry.db'}",
        ArtifactStore(tmp_path / "store"),
        base_model_dir=llama_dir,
        storage_base=registry.base(repo),
    )

    def manifest_status(uri: str) -> int:
        return httpx.get(
            f"http://{registry.host}/v2/{repo}/manifests/{OciRef.parse(uri).digest}",
            auth=(USER, PASSWORD),
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        ).status_code

    return reg, manifest_status


def test_a_retired_revisions_manifest_leaves_the_repository(
    registry, adapter_v1, llama_dir, tmp_path, monkeypatch
):
    """A name keeping 1 revision on an OCI storage base: the retired revision's manifest is
    deleted with its local copy; its bytes registered again are pushed again, to the same URI."""
    from tinymodels import make_adapter

    secret = _login_file(tmp_path / ".dockerconfigjson", registry.host, PASSWORD)
    monkeypatch.setenv("LORAPLEX_OCI_AUTH_FILE", str(secret))
    v2 = make_adapter(llama_dir, tmp_path / "v2", seed=2, r=4, target_modules=["q_proj"])
    reg, manifest_status = _pushing_registry(registry, llama_dir, tmp_path, "loras/retired")

    try:
        reg.init()
        first = reg.add_revision(adapter_v1, "policy", status="stable", keep=1)
        assert manifest_status(first.storage_uri) == 200
        second = reg.add_revision(v2, "policy", status="stable")
        assert (manifest_status(first.storage_uri), manifest_status(second.storage_uri)) == (
            404,
            200,
        )
        assert not reg.store.has(first.digest)
        [event] = [e for e in reg.audit_events(50) if e.action == "delete_artifact"]
        assert event.detail == {"local": True, "oci": first.storage_uri, "oci_deleted": True}
        again = reg.add_revision(adapter_v1, "other", status="stable")
        assert again.storage_uri == first.storage_uri
        assert manifest_status(again.storage_uri) == 200
    finally:
        reg.close()


class TokenService:
    """A token service as Harbor's or Docker Hub's: checks the basic login, answers a JWT (ES256,
    its certificate in `x5c`) granting the scope asked for, which the registry verifies against
    its root certificate."""

    def __init__(self, root: Path):
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplex-test-tokens")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = root / "tokens.pem"
        self.bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.scopes: list[str] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def auth(self) -> dict:
        return {
            "token": {
                "realm": self.realm,
                "service": "loraplex-test",
                "issuer": "loraplex-test-tokens",
                "rootcertbundle": str(self.bundle),
            }
        }

    def token(self, scope: str) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        _, name, actions = scope.split(":")
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [self.x5c]}
        claims = {
            "iss": "loraplex-test-tokens",
            "sub": USER,
            "aud": "loraplex-test",
            "iat": now,
            "nbf": now - 60,
            "exp": now + 300,
            "jti": str(now),
            "access": [{"type": "repository", "name": name, "actions": actions.split(",")}],
        }
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(
            self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256()))
        )
        return f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def handler(self):
        service = self
        login = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                query = parse_qs(urlsplit(self.path).query)
                if self.headers.get("Authorization") != login:
                    self.send_response(401)
                    self.end_headers()
                    return
                service.scopes.append(query["scope"][0])
                body = json.dumps({"token": service.token(query["scope"][0])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):
                pass

        return Handler

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_bearer_tokens_from_the_registrys_token_service(tmp_path):
    tokens = TokenService(tmp_path)
    server = Registry(tmp_path, tokens.auth())
    try:
        src = fake_adapter(tmp_path / "a", b"behind a token service")
        digest = canonical_digest(src)
        base = server.base("loras/tokens")
        auth = RegistryAuth({server.host: (USER, PASSWORD)})
        uri = push_artifact(src, digest, base, auth)
        # the registry's challenge names the actions in either order
        pushes = [s.rsplit(":", 1) for s in tokens.scopes]
        assert ["repository:loras/tokens", {"pull", "push"}] in [
            [repo, set(actions.split(","))] for repo, actions in pushes
        ]
        with pytest.raises(ArtifactUnavailable, match="token service answered 401"):
            fetch_artifact(
                uri,
                digest,
                ArtifactStore(tmp_path / "w1"),
                AllowList.parse([base]),
                oci_auth=RegistryAuth({}),
            )
        path = fetch_artifact(
            uri, digest, ArtifactStore(tmp_path / "w2"), AllowList.parse([base]), oci_auth=auth
        )
        assert canonical_digest(path) == digest
    finally:
        server.stop()
        tokens.stop()


def test_gc_deletes_a_retired_manifest_that_the_repository_refused_to_delete(
    registry, adapter_v1, llama_dir, tmp_path, monkeypatch
):
    """The retirement's delete is refused (a login without the rights): the manifest stays, the
    refusal is audited, and `gc` deletes it once the login works; a second `gc` has nothing left."""
    from tinymodels import make_adapter

    good = _login_file(tmp_path / "good.json", registry.host, PASSWORD)
    bad = _login_file(tmp_path / "bad.json", registry.host, "wrong")
    monkeypatch.setenv("LORAPLEX_OCI_AUTH_FILE", str(good))
    v2 = make_adapter(llama_dir, tmp_path / "v2", seed=2, r=4, target_modules=["q_proj"])
    reg, manifest_status = _pushing_registry(registry, llama_dir, tmp_path, "loras/refused")

    try:
        reg.init()
        first = reg.add_revision(adapter_v1, "policy", status="stable")
        reg.add_revision(v2, "policy", status="stable")
        monkeypatch.setenv("LORAPLEX_OCI_AUTH_FILE", str(bad))
        reg.set_keep("policy", 1)  # retires the first revision; its delete is refused
        assert manifest_status(first.storage_uri) == 200
        assert not reg.store.has(first.digest)  # the local copy went first
        [refused] = [e for e in reg.audit_events(50) if e.action == "delete_artifact"]
        assert "error" in refused.detail
        assert reg.gc_artifacts() == []  # still refused: nothing deleted, tried again later
        monkeypatch.setenv("LORAPLEX_OCI_AUTH_FILE", str(good))
        assert reg.gc_artifacts() == [first.digest]
        assert manifest_status(first.storage_uri) == 404
        deleted = [e for e in reg.audit_events(50) if e.action == "delete_artifact"][0]
        assert deleted.detail == {"local": False, "oci": first.storage_uri, "oci_deleted": True}
        assert reg.gc_artifacts() == []
    finally:
        reg.close()
