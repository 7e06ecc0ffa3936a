"""A real Prometheus server (the `prometheus` binary; Debian package `prometheus`) scraping a target every second, and
its HTTP API's instant queries (tests/servers/test_prometheus_grafana.py, test_prometheus_counters.py). Without the
binary a test skips, except under CI (`CI=true`), where it fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary:
        return binary
    message = "the `prometheus` binary is not on PATH (Debian/Ubuntu: apt-get install prometheus)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; under CI a server-backed test fails instead of skipping")
    pytest.skip(message)


@contextmanager
def prometheus_server(binary: str, target: str, folder: Path) -> Iterator[str]:
    """A Prometheus that scrapes `target` (host:port) every second; yields its base URL."""
    folder.mkdir(parents=True)
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": [{"job_name": "aspen",
                                                          "static_configs": [{"targets": [target]}]}]}))
    address = f"127.0.0.1:{free_port()}"
    log = (folder / "prometheus.log").open("w")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{address}"
    try:
        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited ({process.returncode}): "
                                     f"{(folder / 'prometheus.log').read_text()}")
            try:
                return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
            except OSError:
                return False
        wait_for(ready, timeout=30, what="prometheus to start")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(prometheus: str, expression: str) -> list[dict]:
    """An instant query through Prometheus' HTTP API; its result vector."""
    address = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
    answer = json.load(urllib.request.urlopen(address, timeout=10))
    assert answer["status"] == "success", (expression, answer)
    return answer["data"]["result"]


def number(prometheus: str, expression: str) -> float | None:
    result = query(prometheus, expression)
    return float(result[0]["value"][1]) if result else None
