"""An S3 endpoint for the s3:// store's tests: moto's standalone server (`ThreadedMotoServer`) on a
loopback port, with a bucket and an IAM login that it enforces.

No S3-compatible server runs on this machine or in CI (no MinIO), and AWS is out of reach: moto's
server is the S3 HTTP API as boto3 speaks it, signatures checked, which is the boundary these tests
stand in for. What it does not show: S3's consistency, multipart limits, or another service's
quirks (MinIO, Ceph)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

BUCKET = "loras"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    key_id: str
    secret: str

    def env(self, key_id: str | None = None, secret: str | None = None) -> dict[str, str]:
        """The AWS environment a process reads its login and endpoint from (what the chart's
        Secret and `store.s3Endpoint` give a worker)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": key_id or self.key_id,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }

    def client(self, key_id: str | None = None, secret: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=key_id or self.key_id,
            aws_secret_access_key=secret or self.secret,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Endpoint]:
    """moto's server on loopback with the bucket `loras` and one IAM user allowed s3:*; from then
    on every request must be signed with that user's key."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    setup = {"endpoint_url": url, "region_name": REGION}
    setup |= {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
    try:
        # moto keeps its state per process: a server started earlier in this process (another test
        # module's) left its bucket and user behind
        httpx.post(f"{url}/moto-api/reset").raise_for_status()
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="operator")
        policy = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
        iam.put_user_policy(
            UserName="operator",
            PolicyName="loras",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
        )
        key = iam.create_access_key(UserName="operator")["AccessKey"]
        httpx.post(f"{url}/moto-api/reset-auth", content=b"0").raise_for_status()
        yield S3Endpoint(url, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/moto-api/reset-auth", content=b"inf")
        server.stop()
