"""The `closes_tinker_clients` fixture (tests/conftest.py) after a test that failed with a Tinker client still
open: before, its teardown sent the SDK's close to a server already stopped, which retried for its whole minute
and added a TimeoutError to the real failure (~70 s); now the client is closed here, promptly, and only the real
failure is reported. The reference: pytest's own report of a run of such a test (a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

ROOT = Path(__file__).resolve().parents[2]

INNER = '''
import pytest
import tinker

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")


def test_fails_with_a_client_open(sdk_server):
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    assert 1 == 2, "the real failure"
'''


def test_a_failed_test_with_a_client_open_reports_only_its_failure_promptly(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import closes_tinker_clients, "
                                          "pytest_runtest_makereport  # noqa: F401\n"
                                          "from tests.servers.conftest import sdk_server  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(INNER)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-3000:]
    assert re.fullmatch(r"1 failed in [\d.]+s", summary), run.stdout[-3000:]
    assert "AssertionError: the real failure" in run.stdout and "TimeoutError" not in run.stdout
    assert float(re.search(r"in ([\d.]+)s", summary).group(1)) < 30   # was 62 s, the close's minute
