"""OCI registries as an artifact store: an adapter is an OCI artifact (one blob per file, named by
its sha256, and an image manifest of artifactType `application/vnd.loraplex.adapter.v1`), pushed
and pulled over the distribution HTTP API and named by its manifest's digest, never by a tag.

    oci://HOST[:PORT]/REPOSITORY@sha256:<manifest hex>       # https
    oci+http://HOST[:PORT]/REPOSITORY@sha256:<manifest hex>  # plain http (a loopback registry)

Credentials come from a docker config file (`auths`), the format a Kubernetes
`kubernetes.io/dockerconfigjson` Secret mounts: see `RegistryAuth.from_environ`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from loraplex.artifacts.digests import (
    CHUNK_BYTES,
    artifact_files,
    check_digest,
    is_artifact_name,
)
from loraplex.artifacts.errors import ArtifactUnavailable, DigestMismatch, UnsafeLocation

if TYPE_CHECKING:  # imported where used: it is slow to import for every CLI command
    import httpx

OCI_SCHEMES = ("oci", "oci+http")
ARTIFACT_TYPE = "application/vnd.loraplex.adapter.v1"
FILE_MEDIA_TYPE = "application/vnd.loraplex.adapter.file.v1"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
TITLE = "org.opencontainers.image.title"
ADAPTER_DIGEST = "io.loraplex.adapter.digest"
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's own limit for a manifest
AUTH_FILE_ENV = "LORAPLEX_OCI_AUTH_FILE"
# the distribution spec's repository name grammar
REPOSITORY_RE = re.compile(
    r"^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*$"
)


def is_oci_uri(uri: str) -> bool:
    return urlsplit(uri).scheme in OCI_SCHEMES


@dataclass(frozen=True)
class OciRef:
    """A repository of a registry, and a manifest in it when `digest` is set."""

    scheme: str
    host: str
    """HOST[:PORT], as the registry is addressed (and its credentials are keyed)."""
    repository: str
    digest: str | None = None

    @classmethod
    def parse(cls, uri: str) -> OciRef:
        """`oci://HOST[:PORT]/REPOSITORY[@sha256:HEX]`; UnsafeLocation for anything else (a tag
        included: a tag can be moved to other bytes)."""
        parts = urlsplit(uri)
        if parts.scheme not in OCI_SCHEMES:
            raise UnsafeLocation(f"{uri}: not an oci:// or oci+http:// URI")
        if parts.username or parts.password:
            raise UnsafeLocation(f"{uri}: credentials in a storage URI are refused")
        if not parts.hostname or parts.query or parts.fragment:
            raise UnsafeLocation(f"{uri}: expected oci://HOST[:PORT]/REPOSITORY[@sha256:HEX]")
        repository, _, digest = parts.path.strip("/").partition("@")
        if ":" in repository:
            raise UnsafeLocation(f"{uri}: tags are refused; name the manifest by @sha256:...")
        if not REPOSITORY_RE.fullmatch(repository):
            raise UnsafeLocation(f"{uri}: {repository!r} is not an OCI repository name")
        return cls(parts.scheme, parts.netloc, repository, check_digest(digest) if digest else None)

    @property
    def api(self) -> str:
        """The repository's base URL in the distribution API."""
        http = "http" if self.scheme == "oci+http" else "https"
        return f"{http}://{self.host}/v2/{self.repository}"

    def at(self, digest: str) -> str:
        return f"{self.scheme}://{self.host}/{self.repository}@{check_digest(digest)}"


@dataclass(frozen=True)
class RegistryAuth:
    """User and password per registry host, from a docker config file's `auths`."""

    logins: Mapping[str, tuple[str, str]] = field(repr=False)  # passwords stay out of logs

    @classmethod
    def from_file(cls, path: str | Path) -> RegistryAuth:
        try:
            auths = json.loads(Path(path).read_text()).get("auths", {})
            logins = {_host_key(key): _login(entry) for key, entry in auths.items()}
        except (OSError, ValueError, AttributeError, TypeError, binascii.Error) as exc:
            raise ArtifactUnavailable(
                f"{path}: not a readable docker config file with `auths` ({exc})"
            ) from None
        return cls({host: login for host, login in logins.items() if login is not None})

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RegistryAuth:
        """The file named by LORAPLEX_OCI_AUTH_FILE, else REGISTRY_AUTH_FILE, else
        $DOCKER_CONFIG/config.json, else ~/.docker/config.json; none: anonymous. Read at each
        push and pull, so a rotated Secret is used once the kubelet has updated it."""
        env = os.environ if environ is None else environ
        for name in (AUTH_FILE_ENV, "REGISTRY_AUTH_FILE"):
            if env.get(name):
                return cls.from_file(env[name])
        config_dir = Path(env["DOCKER_CONFIG"]) if env.get("DOCKER_CONFIG") else None
        default = (config_dir or Path.home() / ".docker") / "config.json"
        return cls.from_file(default) if default.is_file() else cls({})

    def basic(self, host: str) -> str | None:
        """The Authorization header value for `host`'s login, if there is one."""
        login = self.logins.get(host)
        if login is None:
            return None
        return "Basic " + base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()


def _host_key(key: str) -> str:
    # docker config keys are `host[:port]`, sometimes written as a URL
    return urlsplit(key).netloc if "://" in key else key.split("/")[0]


def _login(entry: dict) -> tuple[str, str] | None:
    if entry.get("auth"):
        user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
        if not sep:
            raise ValueError("an `auth` value is base64 of user:password")
        return user, password
    if entry.get("username"):
        return str(entry["username"]), str(entry.get("password", ""))
    return None


class OciRepository:
    """The distribution API of one repository, with the auth its registry challenges for (basic,
    or a bearer token from the challenge's realm)."""

    def __init__(
        self,
        ref: OciRef,
        auth: RegistryAuth,
        client: httpx.Client,
        timeout_s: float,
        push: bool = False,
    ):
        self.ref, self.auth, self.client, self.timeout_s = ref, auth, client, timeout_s
        self.actions = "pull,push" if push else "pull"
        self.authorization: str | None = None

    def send(
        self, method: str, url: str, stream: bool = False, allow: tuple[int, ...] = (), **kwargs
    ) -> httpx.Response:
        """The response, after answering one auth challenge; ArtifactUnavailable for an error
        status (404 included) other than those in `allow`."""
        headers = kwargs.pop("headers", {})
        rewind = getattr(kwargs.get("content"), "seek", None)
        for attempt in range(2):
            if attempt and rewind is not None:
                rewind(0)  # a file sent before the challenge is sent again from its start
            request = self.client.build_request(
                method, url, headers=self._headers(headers), **kwargs
            )
            response = self.client.send(request, stream=stream, follow_redirects=method == "GET")
            if response.status_code != 401 or attempt:
                break
            answer = self._answer(response.headers.get("www-authenticate", ""))
            if answer is None:
                break
            response.close()
            self.authorization = answer
        if response.status_code >= 400 and response.status_code not in allow:
            text = "" if stream else response.read()[:300].decode(errors="replace")
            response.close()
            raise ArtifactUnavailable(
                f"{self.ref.host}/{self.ref.repository}: {method} {urlsplit(url).path} answered "
                f"{response.status_code} {text}".rstrip()
            )
        return response

    def _headers(self, headers: dict) -> dict:
        headers = dict(headers)
        if self.authorization:
            headers["Authorization"] = self.authorization
        return headers

    def _answer(self, challenge: str) -> str | None:
        scheme, _, rest = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        basic = self.auth.basic(self.ref.host)
        if scheme.lower() == "basic":
            return basic
        if scheme.lower() != "bearer" or "realm" not in params:
            return None
        scope = params.get("scope") or f"repository:{self.ref.repository}:{self.actions}"
        query = {"scope": scope, **({"service": params["service"]} if "service" in params else {})}
        response = self.client.get(
            params["realm"],
            params=query,
            headers={"Authorization": basic} if basic else {},
            timeout=self.timeout_s,
        )
        if response.status_code >= 400:
            raise ArtifactUnavailable(
                f"{params['realm']}: the token service answered {response.status_code}"
            )
        try:
            answer = response.json()
            return f"Bearer {answer.get('token') or answer['access_token']}"
        except (ValueError, KeyError, AttributeError):
            raise ArtifactUnavailable(
                f"{params['realm']}: the token service sent no token"
            ) from None

    def has_blob(self, digest: str) -> bool:
        url = f"{self.ref.api}/blobs/{digest}"
        try:
            self.send("HEAD", url, timeout=self.timeout_s)
        except ArtifactUnavailable:
            return False
        return True

    def push_blob(self, digest: str, body) -> None:
        """Upload `body` (bytes or an open file) as blob `digest`, unless the repository has it."""
        if self.has_blob(digest):
            return
        import httpx

        started = self.send("POST", f"{self.ref.api}/blobs/uploads/", timeout=self.timeout_s)
        location = httpx.URL(self.ref.api).join(started.headers["location"])
        self.send(
            "PUT",
            str(location.copy_merge_params({"digest": digest})),
            content=body,
            headers={"Content-Type": "application/octet-stream"},
            timeout=self.timeout_s,
        )

    def push_manifest(self, manifest: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        self.send(
            "PUT",
            f"{self.ref.api}/manifests/{digest}",
            content=manifest,
            headers={"Content-Type": MANIFEST_MEDIA_TYPE},
            timeout=self.timeout_s,
        )
        return digest

    def manifest(self, digest: str) -> bytes:
        """The manifest's bytes, after checking that they hash to `digest`."""
        response = self.send(
            "GET",
            f"{self.ref.api}/manifests/{digest}",
            stream=True,
            headers={"Accept": MANIFEST_MEDIA_TYPE},
            timeout=self.timeout_s,
        )
        with contextlib.closing(response):
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise ArtifactUnavailable(f"{self.ref.at(digest)}: the manifest is too large")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise DigestMismatch(digest, actual, f"{self.ref.at(digest)} (manifest)")
        return bytes(data)

    @contextlib.contextmanager
    def blob(self, digest: str) -> Iterator[Iterator[bytes]]:
        """The blob's bytes as they come (the caller checks them against `digest`)."""
        url = f"{self.ref.api}/blobs/{digest}"
        response = self.send("GET", url, stream=True, timeout=self.timeout_s)
        with contextlib.closing(response):
            yield response.iter_bytes(CHUNK_BYTES)


@dataclass(frozen=True)
class Layer:
    """One artifact file as the manifest lists it."""

    name: str
    digest: str
    size: int


def build_manifest(layers: list[Layer], adapter_digest: str) -> bytes:
    """The artifact's manifest; the same files give the same bytes (so the same digest)."""
    empty = {
        "mediaType": EMPTY_MEDIA_TYPE,
        "digest": "sha256:" + hashlib.sha256(EMPTY_BLOB).hexdigest(),
        "size": len(EMPTY_BLOB),
        "data": base64.b64encode(EMPTY_BLOB).decode(),
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": empty,
        "layers": [
            {
                "mediaType": FILE_MEDIA_TYPE,
                "digest": layer.digest,
                "size": layer.size,
                "annotations": {TITLE: layer.name},
            }
            for layer in layers
        ],
        "annotations": {ADAPTER_DIGEST: check_digest(adapter_digest)},
    }
    return json.dumps(manifest, separators=(",", ":")).encode()


def parse_layers(manifest: bytes, where: str) -> list[Layer]:
    """The files a manifest lists; UnsafeLocation for a name that is not an artifact file's."""
    try:
        data = json.loads(manifest)
        if data.get("artifactType") != ARTIFACT_TYPE:
            raise ValueError(f"artifactType {data.get('artifactType')!r}, not {ARTIFACT_TYPE}")
        layers = [
            Layer(str(layer["annotations"][TITLE]), str(layer["digest"]), int(layer["size"]))
            for layer in data["layers"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactUnavailable(f"{where}: not a loraplex adapter manifest ({exc})") from None
    names = [layer.name for layer in layers]
    for layer in layers:
        if not is_artifact_name(layer.name) or layer.size < 0:
            raise UnsafeLocation(
                f"{where} lists {layer.name!r}, which is not an artifact file name"
            )
        check_digest(layer.digest)
    if len(set(names)) != len(names):
        raise UnsafeLocation(f"{where} lists a file name twice")
    return layers


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def push_artifact(
    directory: Path,
    adapter_digest: str,
    base: str,
    auth: RegistryAuth | None = None,
    timeout_s: float = 30.0,
    http_client: httpx.Client | None = None,
) -> str:
    """Push the artifact in `directory` (already checked to hash to `adapter_digest`) to the
    repository `base` names; returns its storage URI (`base@sha256:<manifest>`). Blobs the
    repository has are not sent again."""
    import httpx

    ref = OciRef.parse(base)
    if ref.digest is not None:
        raise UnsafeLocation(f"{base}: push to a repository, not to a manifest")
    auth = RegistryAuth.from_environ() if auth is None else auth
    with contextlib.ExitStack() as stack:
        if http_client is None:
            http_client = stack.enter_context(httpx.Client(timeout=timeout_s))
        repo = OciRepository(ref, auth, http_client, timeout_s, push=True)
        try:
            layers = []
            for name in artifact_files(directory):
                path = directory / name
                layer = Layer(name, file_sha256(path), path.stat().st_size)
                with path.open("rb") as body:
                    repo.push_blob(layer.digest, body)
                layers.append(layer)
            repo.push_blob("sha256:" + hashlib.sha256(EMPTY_BLOB).hexdigest(), EMPTY_BLOB)
            return ref.at(repo.push_manifest(build_manifest(layers, adapter_digest)))
        except httpx.HTTPError as exc:
            raise ArtifactUnavailable(f"{base}: {type(exc).__name__}: {exc}") from None


def delete_pushed(
    uri: str,
    auth: RegistryAuth | None = None,
    timeout_s: float = 30.0,
    http_client: httpx.Client | None = None,
) -> bool:
    """Delete the manifest a storage URI (`base@sha256:<manifest>`) names; False when the
    repository has it no more. Its blobs stay, as other manifests may list them (an adapter's
    config often is the same bytes in every revision): the registry's own garbage collection
    deletes the blobs no manifest lists."""
    import httpx

    ref = OciRef.parse(uri)
    if ref.digest is None:
        raise UnsafeLocation(f"{uri}: name the manifest to delete by @sha256:...")
    auth = RegistryAuth.from_environ() if auth is None else auth
    with contextlib.ExitStack() as stack:
        if http_client is None:
            http_client = stack.enter_context(httpx.Client(timeout=timeout_s))
        repo = OciRepository(ref, auth, http_client, timeout_s, push=True)
        repo.actions = "pull,push,delete"  # the scope a token service grants a DELETE for
        url = f"{ref.api}/manifests/{ref.digest}"
        try:
            return repo.send("DELETE", url, allow=(404,), timeout=timeout_s).status_code != 404
        except httpx.HTTPError as exc:
            raise ArtifactUnavailable(f"{uri}: {type(exc).__name__}: {exc}") from None
