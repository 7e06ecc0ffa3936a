"""`aspen run` with a jobs file whose policy raises on every job: the service replaces it by FIFO (logged in the
service, reported by `client.info()["policy_error"]`, docs/scheduling.md), and the run's jobs train. The run said
nothing of it: exit 0, the jobs' table, not a word on stderr, so a policy author took FIFO's schedule for their
policy's. It now warns on stderr, naming the policy and its error. The reference: the same jobs file with a working
policy (FIFO itself) warns of nothing. The real CLI in a subprocess, through a service on a local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.interrupted_runs import write_run

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_aspen_run_warns_that_its_policy_failed_and_fifo_scheduled_the_jobs(tmp_path, tiny_model_dirs):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    runs = {}
    for policy in ("tests.helpers.fault_policies:AlwaysFails", "fifo"):
        folder = tmp_path / policy.rsplit(":", 1)[-1]
        jobs = write_run(folder, tiny_model_dirs["llama"], steps=2)
        jobs.write_text(f"policy: {policy}\n" + jobs.read_text())
        runs[policy] = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--quiet", "jobs.yaml"],
                                      cwd=folder, capture_output=True, text=True, timeout=400, env=env)
    broken, fifo = runs.values()
    assert broken.returncode == fifo.returncode == 0, (broken.stderr, fifo.stderr)
    assert "completed" in broken.stdout and "completed" in fifo.stdout
    assert ("aspen: warning: the jobs file's scheduling policy was not used: policy 'always-fails' failed "
            "(RuntimeError('this policy is broken'))") in broken.stderr, broken.stderr
    assert "so FIFO scheduled these jobs" in broken.stderr
    assert "warning" not in fifo.stderr, fifo.stderr


@pytest.mark.long   # 35-75 s here: three runs of two 2-step jobs in-process
def test_aspen_run_in_process_warns_as_the_service_path_does(tmp_path, tiny_model_dirs):
    """`aspen run --in-process` with the same failing policy: FIFO replaced it (its own log said so amid the run's
    lines, the end nothing), now the same warning as through the service ends it; the reference is that warning as
    the service path words it (the test above) and FIFO itself, which warns of nothing. A policy that decides on a
    job that does not exist has it said once at the end too (`policy_warnings`), where its log line was lost among
    the run's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    runs = {}
    for policy in ("tests.helpers.fault_policies:AlwaysFails", "fifo", "tests.helpers.fault_policies:DecidesOnGhosts"):
        folder = tmp_path / policy.rsplit(":", 1)[-1]
        jobs = write_run(folder, tiny_model_dirs["llama"], steps=2)
        jobs.write_text(f"policy: {policy}\n" + jobs.read_text())
        runs[policy] = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "--quiet",
                                       "jobs.yaml"], cwd=folder, capture_output=True, text=True, timeout=400, env=env)
    broken, fifo, ghosts = runs.values()
    assert broken.returncode == fifo.returncode == ghosts.returncode == 0, (broken.stderr, fifo.stderr, ghosts.stderr)
    assert "completed" in broken.stdout and "completed" in fifo.stdout and "completed" in ghosts.stdout
    said = [line for line in ghosts.stderr.splitlines() if line.startswith("aspen: warning: ")]
    assert said == ["aspen: warning: policy 'decides-on-ghosts' decided Start(job='ghost-job', trainer='in-process'), "
                    "but the scheduler has no active job 'ghost-job': not done"], ghosts.stderr
    assert ("aspen: warning: the jobs file's scheduling policy was not used: policy 'always-fails' failed "
            "(RuntimeError('this policy is broken')); the service schedules FIFO until it restarts with a working "
            "policy, so FIFO scheduled these jobs") in broken.stderr, broken.stderr
    assert "warning" not in fifo.stderr, fifo.stderr
