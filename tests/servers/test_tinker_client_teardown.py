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


def _pytest_of(tmp_path: Path, test_file: str) -> subprocess.CompletedProcess:
    """pytest's own run (a subprocess) of `test_file`, with the project's fixture that closes Tinker clients and a
    served tiny base (`sdk_server`)."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import closes_tinker_clients, "
                                          "pytest_runtest_makereport  # noqa: F401\n"
                                          "from tests.servers.conftest import sdk_server  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(test_file)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_failed_test_with_a_client_open_reports_only_its_failure_promptly(tmp_path):
    run = _pytest_of(tmp_path, INNER)
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-3000:]
    assert re.fullmatch(r"1 failed in [\d.]+s", summary), run.stdout[-3000:]
    assert "AssertionError: the real failure" in run.stdout and "TimeoutError" not in run.stdout
    assert float(re.search(r"in ([\d.]+)s", summary).group(1)) < 30   # was 62 s, the close's minute


INNER_SHADOW = '''
import gc
import pickle

import tinker
from tinker.lib.internal_client_holder import InternalClientHolder

from tests.helpers.tinker_api import train_steps


def test_a_sampler_rebuilt_from_a_pickle(sdk_server, closes_tinker_clients):   # closed while the server runs
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    train_steps(training, (1,))
    sampler = training.save_weights_and_get_sampling_client().result()
    pickle.loads(pickle.dumps(sampler))   # as a worker process would: its session's shadow holder


def test_no_session_heartbeats_on_after_it():
    gc.collect()
    beating = [holder._session_id for holder in gc.get_objects() if isinstance(holder, InternalClientHolder)
               and holder._session_id and not holder._closed]
    assert not beating, beating
'''


def test_a_sampler_rebuilt_from_a_pickle_stops_its_heartbeats_when_its_test_ends(tmp_path):
    """A sampling client rebuilt from a pickle (or a sampler handle) in the test's own process shares its session
    through the SDK's shadow holder, which the SDK never closes there: it went on heartbeating after the test, and
    once the server had stopped its "Session heartbeat failed" warnings reached a later test's caplog (CI failed
    on one). The fixture closes such holders too. The reference: the SDK's holders, found by the garbage
    collector in the next test of the same process."""
    run = _pytest_of(tmp_path, INNER_SHADOW)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1].startswith("2 passed"), run.stdout[-3000:]
