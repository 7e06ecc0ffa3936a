"""`aspen run` as a user runs it, interrupted the ways users interrupt it, then run again:

- SIGTERM to the command (`kill`): as Ctrl-C, exit 143, without Ray's C++ stack;
- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): one line, exit 130, no traceback,
  running jobs checkpointed; the same command again resumes them and they end as an uninterrupted run;
- the same command once more: finished jobs are left alone, one line each, exit 0;
- the spec changed in a way that makes resuming wrong, or a job's data file was rewritten in place (same
  path, same row count, one row's text changed): exit 2, naming the job, the field or the file, and
  `--overwrite`; with `--overwrite` the jobs start over (on the changed data), and only those: a job finished
  and unchanged beside a changed one is left alone;
- everything killed at once (SIGKILL to the process group: `ray stop`, a reboot): the same command resumes
  every unfinished job from its last checkpoint, written by time (`checkpoint_every_s`) as well as by
  step, and the adapters equal those of an undisturbed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.interrupted_runs import (
    KILLED_STEPS,
    NO_RAY,
    STEPS,
    assert_like_undisturbed,
    change_a_row,
    checkpoint_step,
    finish,
    interrupt_once_checkpointed,
    metric_steps,
    run,
    start,
    write_run,
)
from tests.helpers.service import wait_for


@pytest.mark.long
def test_sigterm_stops_like_ctrl_c_without_rays_stack(tmp_path, tiny_model_dirs):
    """`kill PID` (SIGTERM, as a job system or a supervisor stops a command): the running jobs checkpointed, one
    line, exit 143; not Ray's C++ "SIGTERM received" stack (the same command resumes them as after Ctrl-C)."""
    write_run(tmp_path, tiny_model_dirs["llama"])
    # the command only, not its group
    code, out, err = interrupt_once_checkpointed(start(tmp_path), tmp_path, step=4, signal_number=signal.SIGTERM)
    assert code == 143, (code, out, err)
    assert "SIGTERM received" not in err + out and "logging.cc" not in err and "Traceback" not in err, err
    assert "stopped (SIGTERM)" in err and "the running jobs were checkpointed" in err, err
    stopped_at = {n: checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")}
    assert all(0 < step < STEPS for step in stopped_at.values()), stopped_at   # resuming: the Ctrl-C test below


@pytest.mark.long
def test_ctrl_c_then_the_same_command_continues_and_finished_jobs_are_left_alone(tmp_path, tiny_model_dirs):
    base = tiny_model_dirs["llama"]
    write_run(tmp_path, base)
    code, out, err = interrupt_once_checkpointed(start(tmp_path), tmp_path)   # Ctrl-C in the terminal
    assert code == 130, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert "interrupted" in err and "the same command continues" in err, err
    interrupted_at = {n: checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")}
    assert all(0 < step < STEPS for step in interrupted_at.values()), interrupted_at

    code, out, err = run(tmp_path)                   # the same command again
    assert code == 0, (out, err)
    for name in ("first", "second"):
        assert f"{name}: " in out and "resumes from its checkpoint at step" in out, out
        assert metric_steps(tmp_path / "out" / name) == list(range(1, STEPS + 1))
    assert_like_undisturbed(tmp_path, base)

    adapter = (tmp_path / "out/first/adapter_model.safetensors").read_bytes()
    started = time.monotonic()
    code, out, err = run(tmp_path, env=NO_RAY)       # and once more: nothing left to do, and no Ray needed
    assert code == 0, (out, err)
    assert f"first: already completed at step {STEPS}; left alone" in out, out
    assert f"second: already completed at step {STEPS}; left alone" in out, out
    assert (tmp_path / "out/first/adapter_model.safetensors").read_bytes() == adapter
    assert time.monotonic() - started < 60

    change_a_row(tmp_path / "data" / "second.jsonl")   # its data rewritten in place: the same stop as a spec change
    code, out, err = run(tmp_path, env=NO_RAY)
    assert code == 2, (code, out, err)
    assert f"job 'second': data: {tmp_path / 'data' / 'second.jsonl'} changed since its checkpoint at step {STEPS}" \
        in err and "--overwrite" in err, err
    assert "job 'first'" not in err and "Traceback" not in err, err

    write_run(tmp_path, base, lr="2.0e-3")           # a change that makes the old results wrong
    change_a_row(tmp_path / "data" / "second.jsonl")
    code, out, err = run(tmp_path, env=NO_RAY)
    assert code == 2, (code, out, err)
    assert "job 'first': lr: 0.001 -> 0.002" in err and "--overwrite" in err, err
    assert "second" not in err.split("job 'first'")[1].splitlines()[0]
    assert "job 'second': data: " in err, err
    assert "Traceback" not in err

    # --overwrite: the job whose data changed starts over on the files as they are; the finished, unchanged one
    # beside it is left alone (spec and data changes are one case for the plan: its changed records start over)
    write_run(tmp_path, base)                        # the spec as it was (writing the run wrote the data again)
    change_a_row(tmp_path / "data" / "second.jsonl")
    second = (tmp_path / "out/second/adapter_model.safetensors").read_bytes()
    code, out, err = run(tmp_path, "--overwrite")
    assert code == 0, (out, err)
    assert "second: started over (--overwrite: its spec or data changed)" in out, out
    assert f"first: already completed at step {STEPS}; left alone" in out, out
    assert "first: started over" not in out
    assert (tmp_path / "out/first/adapter_model.safetensors").read_bytes() == adapter   # never deleted
    assert (tmp_path / "out/second/adapter_model.safetensors").read_bytes() != second   # trained on the changed row
    for name in ("first", "second"):
        assert metric_steps(tmp_path / "out" / name) == list(range(1, STEPS + 1))
    assert_like_undisturbed(tmp_path, base, names=("second",))   # as an undisturbed run on the data as it is now


@pytest.mark.long
def test_everything_killed_then_the_same_command_resumes_from_time_based_checkpoints(tmp_path, tiny_model_dirs):
    base = tiny_model_dirs["llama"]
    # checkpoints by time only (no step-based one in reach), the kill at once after the first of each job
    write_run(tmp_path, base, steps=KILLED_STEPS, every=100000, every_s=1)
    process = start(tmp_path)
    wait_for(lambda: min(checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")) >= 1 or
             process.poll() is not None, timeout=300, what="time-based checkpoints", every=0.05)
    assert process.poll() is None, finish(process)
    os.killpg(process.pid, signal.SIGKILL)           # the driver, its Ray, the trainer: all at once
    finish(process)
    killed_at = {n: checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")}
    assert all(0 < step < KILLED_STEPS for step in killed_at.values()), killed_at

    code, out, err = run(tmp_path)
    assert code == 0, (out, err)
    assert out.count("resumes from its checkpoint at step") == 2, out
    for name in ("first", "second"):
        assert metric_steps(tmp_path / "out" / name) == list(range(1, KILLED_STEPS + 1))
    assert_like_undisturbed(tmp_path, base)


@pytest.mark.long
@pytest.mark.parametrize("way", ["service", "in-process"])
def test_ctrl_c_leaves_the_jobs_paused_saying_what_continues_them_in_either_way(tmp_path, tiny_model_dirs, way):
    """Ctrl-C to `aspen run` and to `aspen run --in-process`: `aspen status` afterwards shows each unfinished job
    alike, paused (not queued for a service that is gone), its reason saying that the run stopped and that the same
    command continues it, from which checkpoint (the service's run once left them queued, "the service stopped")."""
    write_run(tmp_path, tiny_model_dirs["llama"])
    command = [] if way == "service" else ["--in-process"]
    code, out, err = interrupt_once_checkpointed(start(tmp_path, *command), tmp_path)
    assert code == 130 and "the same command continues" in err, (code, out, err)
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--json", "--from", "out"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    jobs = {job["name"]: job for job in json.loads(status.stdout)}
    for name in ("first", "second"):
        assert jobs[name]["state"] == "paused", jobs[name]
        assert jobs[name]["reason"].startswith("held: its run stopped before it ended (Ctrl-C, SIGTERM); the same "
                                               "`aspen run` command continues it from its newest checkpoint"), jobs
        assert f"step {checkpoint_step(tmp_path / 'out' / name)} as last reported" in jobs[name]["reason"], jobs
