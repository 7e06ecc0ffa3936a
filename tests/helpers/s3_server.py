"""A real S3-compatible server for tests: moto's `moto_server` (the dev extra), started on a free port as a
separate process, with the environment aspen's storage module reads (AWS_ENDPOINT_URL_S3, credentials).
Used by the `s3_server` fixture (tests/conftest.py). Without the binary tests skip, except under CI
(`CI=true`), where they fail."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.ports import free_port

ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@dataclass(frozen=True)
class S3Server:
    endpoint: str          # http://127.0.0.1:<port>
    pid: int

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket; returns its name."""
        import pyarrow.fs as pafs

        name = name or f"aspen-{uuid.uuid4().hex[:10]}"
        filesystem = pafs.S3FileSystem(endpoint_override=self.endpoint.split("://", 1)[1], scheme="http",
                                       allow_bucket_creation=True, access_key=ENVIRONMENT["AWS_ACCESS_KEY_ID"],
                                       secret_key=ENVIRONMENT["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                                       request_timeout=60)
        filesystem.create_dir(name)
        return name


def moto_server_binary() -> str | None:
    beside = Path(sys.executable).parent / "moto_server"
    return str(beside) if beside.is_file() else shutil.which("moto_server")


@contextmanager
def running_s3_server() -> Iterator[S3Server]:
    """Start moto_server, set the S3 environment for this process (and its children), yield, then kill the
    server by its PID and put the environment back."""
    binary = moto_server_binary()
    if binary is None:
        message = "moto_server is not installed (pip install 'moto[server]', part of the dev extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    # its request log goes to a file: a pipe nobody reads fills up (64 KiB, a few hundred requests) and the
    # server then blocks in every request's log line
    log_file = tempfile.NamedTemporaryFile(prefix="moto-server-", suffix=".log", delete=False)
    process = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=log_file)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {key: os.environ.get(key) for key in (*ENVIRONMENT, "AWS_ENDPOINT_URL_S3")}
    try:
        deadline = time.time() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited ({process.returncode}): "
                                   f"{Path(log_file.name).read_text(errors='replace')[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"moto_server did not listen on port {port} within 30 s") from None
                time.sleep(0.1)
        os.environ.update(ENVIRONMENT)
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
        yield S3Server(endpoint, process.pid)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        log_file.close()
        os.unlink(log_file.name)
