"""`--address auto` (every command's default without RAY_ADDRESS) on a machine where a Ray cluster runs that aspen did
not start: Ray's search takes whatever cluster it finds, and `aspen status` (submit, cancel, serve) went on there
without a word. Now the command says which cluster it uses (its address, the user and the process that started it),
and refuses one another user started unless its address is given. The cluster here is a second Ray head the test
starts (`ray.init` in a process of its own), the only one the search is let find (tests/helpers/cli_cluster_search.py:
the test workers' clusters, and other users', run beside it); the process that started it is the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.found_cluster import current_user
from tests.helpers.ray_nodes import kill_session

REPO = Path(__file__).resolve().parents[2]
SEARCH = REPO / "tests" / "helpers" / "cli_cluster_search.py"
HEAD = ("import ray, time; ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20); "
        "print(ray.get_runtime_context().gcs_address, flush=True); time.sleep(600)")
# `aspen ARGS` as a user other than the cluster's would run it: only whom this process takes itself for is changed
AS_ANOTHER_USER = ("import runpy, sys, orchestrator.found_cluster as found; found.current_user = lambda: 'another'; "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture()
def second_head(tmp_path):
    """A Ray head started by a process of this test (no aspen in it): (its GCS address, that process's id)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    process = subprocess.Popen([sys.executable, "-c", HEAD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True, env={**env, "HOME": str(tmp_path)})
    try:
        address = process.stdout.readline().strip()
        assert address, f"the second Ray head did not start (exit {process.poll()})"
        yield address, process.pid
    finally:
        kill_session(process, rounds=2)


def _aspen(tmp_path: Path, address: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # no earlier run's table (the test session's list of runs names other tests' runs); the cluster's token at
    # home (`ray.init` wrote it), sent as its clients send it
    env.update(FOUND_CLUSTER=address, HOME=str(tmp_path), PYTHONPATH=str(REPO), RAY_AUTH_MODE="token",
               ASPEN_RECENT_RUNS=str(tmp_path / "runs.json"))
    return subprocess.run([sys.executable, *prefix, str(SEARCH), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_auto_says_which_cluster_it_joined_and_refuses_another_users(tmp_path, second_head):
    address, starter = second_head
    status = _aspen(tmp_path, address, "status", "--address", "auto")
    # no aspen service runs on that cluster: said as before, after the line that names the cluster
    assert status.returncode == 1 and f"no aspen service ('aspen-scheduler' in namespace 'aspen') on the Ray cluster " \
        f"at {address}; start one" in status.stderr, status.stderr
    assert (f"aspen: using the Ray cluster at {address}, started by user {current_user()} (process {starter}: "
            f"{sys.executable} -c import ray") in status.stderr, status.stderr
    assert "(found by --address auto; name another with --address)" in status.stderr, status.stderr

    refused = _aspen(tmp_path, address, "status", "--address", "auto", prefix=("-c", AS_ANOTHER_USER))
    assert refused.returncode == 1, refused.stderr
    assert (f"--address auto (the default) found only the Ray cluster at {address}, started by user {current_user()} "
            f"(process {starter}: ") in refused.stderr and "not by you" in refused.stderr, refused.stderr
    assert "aspen: using" not in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    # named explicitly, the same user's cluster is joined without the line (the user chose it)
    named = _aspen(tmp_path, address, "status", "--address", address, prefix=("-c", AS_ANOTHER_USER))
    assert "no aspen service" in named.stderr and "aspen: using" not in named.stderr, named.stderr
