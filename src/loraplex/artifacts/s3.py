"""S3 buckets as an artifact store: the layout of the local store's `sha256/` directory under a
prefix, an adapter's files and its `index.json` under its digest's hex.

    s3://BUCKET/PREFIX/<hex>/index.json
    s3://BUCKET/PREFIX/<hex>/adapter_config.json, adapter_model.safetensors, ...

Credentials, region and endpoint come from boto3's own chain: `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY` (a Kubernetes Secret as environment variables), `AWS_PROFILE` with
`AWS_SHARED_CREDENTIALS_FILE` or `~/.aws/credentials` (a mounted file), an instance or pod role;
`AWS_ENDPOINT_URL` for another service than AWS (MinIO, Ceph).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from loraplex.artifacts.digests import artifact_files, check_digest
from loraplex.artifacts.errors import ArtifactUnavailable, UnsafeLocation

INDEX_FILE = "index.json"
CREDENTIAL_ERRORS = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
)
"""S3 error codes that mean the login is wrong or lacks the rights, not that the store is down."""
CREDENTIALS_HINT = (
    "check the AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and "
    "its credentials file) and the bucket's policy"
)


def is_s3_uri(uri: str) -> bool:
    return urlsplit(uri).scheme == "s3"


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix (no leading or trailing slash; empty: the bucket's root)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        parts = urlsplit(uri)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise UnsafeLocation(f"{uri}: expected s3://BUCKET[/PREFIX]")
        if parts.username or parts.password:
            raise UnsafeLocation(f"{uri}: credentials in a storage URI are refused")
        return cls(parts.netloc, parts.path.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def s3_client(timeout_s: float):
    """A boto3 S3 client with boto3's own credential chain, each call bounded by `timeout_s`. A
    session of its own: the chain is read at each upload and fetch, so a rotated Secret is used once
    the kubelet has updated its file."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ArtifactUnavailable(
            "s3:// storage needs the s3 extra (boto3): pip install 'loraplex[s3]'"
        ) from None
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2})
    return boto3.session.Session().client("s3", config=config)


def s3_error(where: str, exc: Exception) -> ArtifactUnavailable:
    """One line for a boto3 or botocore error; a refused or missing login says what to check."""
    try:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
    except ImportError:  # a client given without boto3 installed
        return ArtifactUnavailable(f"{where}: {type(exc).__name__}: {exc}")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return ArtifactUnavailable(f"{where}: {exc}: {CREDENTIALS_HINT}")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", "")
        hint = f": {CREDENTIALS_HINT}" if code in CREDENTIAL_ERRORS else ""
        return ArtifactUnavailable(f"{where}: S3 answered {code} ({message}){hint}")
    return ArtifactUnavailable(f"{where}: {type(exc).__name__}: {exc}")


def push_s3(
    directory: Path, adapter_digest: str, base: str, client=None, timeout_s: float = 30.0
) -> str:
    """Upload the store entry `directory` (already checked to hash to `adapter_digest`, its
    `index.json` beside the files) under `base`; returns its storage URI `base/<hex>`. The index
    goes last: a reader that finds it finds every file it lists."""
    hex_digest = check_digest(adapter_digest).removeprefix("sha256:")
    entry = S3Location.parse(base)
    entry = S3Location(entry.bucket, entry.key(hex_digest))
    if not (directory / INDEX_FILE).is_file():
        raise ArtifactUnavailable(f"{directory}: no {INDEX_FILE}, not an entry of the store")
    client = s3_client(timeout_s) if client is None else client
    try:
        for name in [*artifact_files(directory), INDEX_FILE]:
            with (directory / name).open("rb") as body:
                client.put_object(Bucket=entry.bucket, Key=entry.key(name), Body=body)
    except Exception as exc:  # botocore raises many unrelated types; each is one line here
        raise s3_error(entry.uri(), exc) from None
    return entry.uri()


def delete_s3(uri: str, client=None, timeout_s: float = 30.0) -> bool:
    """Delete the entry a storage URI (`s3://BUCKET/PREFIX/<hex>`) names, its `index.json` first
    (a reader that finds the index finds every file); False when the bucket had none of it."""
    entry = S3Location.parse(uri)
    client = s3_client(timeout_s) if client is None else client
    try:
        listed = client.list_objects_v2(Bucket=entry.bucket, Prefix=entry.key(""))
        keys = [o["Key"] for o in listed.get("Contents", [])]
        index = entry.key(INDEX_FILE)
        for key in sorted(keys, key=lambda k: k != index):
            client.delete_object(Bucket=entry.bucket, Key=key)
    except Exception as exc:  # botocore raises many unrelated types; each is one line here
        raise s3_error(uri, exc) from None
    return bool(keys)
