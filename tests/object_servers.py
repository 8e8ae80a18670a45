"""A real S3-compatible server for the tests: moto's server mode on a free loopback port.

The server runs in a thread of the test process (no process is started), bound to
127.0.0.1, and is shared by the tests of one worker; each test gets a bucket of its own
(:func:`bucket`). Without moto, boto3 or s3fs the tests are skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import uuid
from typing import Any

import pytest

_shared: dict[str, Any] = {}

#: Credentials for the local server only (moto accepts any).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def require_s3() -> None:
    """Skip the calling test when moto, boto3 or s3fs is missing (fail under CI)."""
    missing = []
    for module in ("moto", "boto3", "s3fs"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        message = f"object store tests need {', '.join(missing)} (pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def s3_endpoint() -> str:
    """The URL of this worker's server, started at first use and stopped at exit."""
    require_s3()
    if "endpoint" not in _shared:
        from moto.server import ThreadedMotoServer

        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        atexit.register(server.stop)
        _shared["server"], _shared["endpoint"] = server, f"http://127.0.0.1:{port}"
    return str(_shared["endpoint"])


def make_bucket(endpoint: str) -> str:
    """A new empty bucket on the server; its name."""
    import boto3

    name = f"tc-{uuid.uuid4().hex[:20]}"
    client = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    client.create_bucket(Bucket=name)  # boto3's client: s3fs's mkdir asks for a location constraint moto refuses
    return name


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def new_bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<new bucket>``, with the environment set so torchcache reaches the local server."""
    endpoint = s3_endpoint()
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHCACHE_STORAGE_OPTIONS", json.dumps({"endpoint_url": endpoint}))
    return f"s3://{make_bucket(endpoint)}"


def filesystem() -> Any:
    """An s3fs filesystem on the server (to look at and damage objects)."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3_endpoint(), key="testing", secret="testing", skip_instance_cache=True)
