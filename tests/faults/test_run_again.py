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
from pathlib import Path

import pytest

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from orchestrator.jobs_file import load_run_spec
from tests.helpers.service import adapter_tensors, max_relative_difference, wait_for, write_task_data

JOBS = """\
base_model: {base}
output_dir: out
step_tokens: 512
jobs:
  - name: first
    data: data/first.jsonl
    format: {{type: prompt_response, prompt: "Q: {{question}}\\nA:", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 4
    max_seq_len: 128
    lr: {lr}
    max_steps: {steps}
    checkpoint_every: {every}
    checkpoint_every_s: {every_s}
  - name: second
    data: data/second.jsonl
    format: {{type: prompt_response, prompt: "Q: {{question}}\\nA:", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 4
    max_seq_len: 128
    lr: 1.0e-3
    max_steps: {steps}
    checkpoint_every: {every}
    checkpoint_every_s: {every_s}
"""


# Steps per job: what the claims need is room for the interruption after the first checkpoints (step 10) and
# before the end; the Ctrl-C (or SIGTERM) reaches the trainer through the scheduler, at nice 10, within a second
# or two on a loaded machine. A fused step of the tiny model's two jobs takes 7.5-20 ms on CI's faster machine
# (a 2-core AMD EPYC, as here: the trainer's step log, 7.5 and 8.0 ms the least of 300 in two runs), not the 10 ms
# floor once assumed (240 steps: 230 after the checkpoint, 1.4 s at 6 ms); with a floor of 6 ms (as a single
# job's 5 ms against its least, 5.7), 2 s are 340 steps after the checkpoint, so 350 steps. Every step here is
# trained up to four times (the run, its resumption, the reference, --overwrite), so fewer steps is most of
# these tests' time.
STEPS = 350
# SIGKILL reaches at once (no checkpoint on the way out); the kill follows the first time-based checkpoint (1 s
# into training), polled every 0.05 s but late by as much as a loaded machine keeps the test's process waiting. A
# fused step of the tiny model's two jobs takes 13-40 ms here (vocabulary 4,096); with a floor of 10 ms (a CPU a
# third faster), at most 100 steps come before that checkpoint and 200 more leave 2 s to spare: 300 steps
KILLED_STEPS = 300


def write_run(folder: Path, base: Path, *, steps: int = STEPS, lr: str = "1.0e-3", every: int = 10,
              every_s: float = 600) -> Path:
    write_task_data(folder / "data", "first")
    write_task_data(folder / "data", "second", offset=5)
    path = folder / "jobs.yaml"
    path.write_text(JOBS.format(base=base, steps=steps, lr=lr, every=every, every_s=every_s))
    return path


# A Ray address nothing answers at: a run that needed Ray would fail on it. The runs that only read the job
# table (every job done, a spec or data changed) get it, to show that they answer without starting Ray.
NO_RAY = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}


def start(folder: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`aspen run jobs.yaml` in its own process group, as a terminal would start it."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--quiet", "jobs.yaml", *args],
                            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def finish(process: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"aspen run did not end within {timeout}s:\n{out}\n{err}") from None
    return process.returncode, out, err


def run(folder: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(start(folder, *args, env=env))


def change_a_row(path: Path) -> None:
    """One row's answer reversed: the same path, row count and size, another row."""
    lines = path.read_text().splitlines()
    row = json.loads(lines[3])
    row["answer"] = row["answer"][::-1]
    lines[3] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")


def checkpoint_step(folder: Path) -> int:
    try:
        return json.loads((folder / "checkpoint" / "state.json").read_text())["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def metric_steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_like_undisturbed(folder: Path, base: Path, names=("first", "second")) -> None:
    spec = load_run_spec(folder / "jobs.yaml")
    reference = folder / f"reference-{len(list(folder.glob('reference-*')))}"   # a new one each time
    jobs = [job for job in spec.jobs if job.name in names]
    train_locally(spec.model_copy(update={"output_dir": reference, "jobs": jobs}),
                  base=load_base_model(str(base), dtype="float32", device="cpu"), progress=False)
    for name in names:
        difference = max_relative_difference(adapter_tensors(folder / "out" / name), adapter_tensors(reference / name))
        assert difference <= 1e-4, f"{name}: {difference:.2e} from an undisturbed run"


def test_sigterm_stops_like_ctrl_c_without_rays_stack(tmp_path, tiny_model_dirs):
    """`kill PID` (SIGTERM, as a job system or a supervisor stops a command): the running jobs checkpointed, one
    line, exit 143; not Ray's C++ "SIGTERM received" stack (the same command resumes them as after Ctrl-C)."""
    write_run(tmp_path, tiny_model_dirs["llama"])
    process = start(tmp_path)
    wait_for(lambda: min(checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")) >= 4 or
             process.poll() is not None, timeout=300, what="both jobs to checkpoint")
    assert process.poll() is None, finish(process)
    process.send_signal(signal.SIGTERM)              # the command only, not its group
    code, out, err = finish(process)
    assert code == 143, (code, out, err)
    assert "SIGTERM received" not in err + out and "logging.cc" not in err and "Traceback" not in err, err
    assert "stopped (SIGTERM)" in err and "the running jobs were checkpointed" in err, err
    stopped_at = {n: checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")}
    assert all(0 < step < STEPS for step in stopped_at.values()), stopped_at   # resuming: the Ctrl-C test below


@pytest.mark.long
def test_ctrl_c_then_the_same_command_continues_and_finished_jobs_are_left_alone(tmp_path, tiny_model_dirs):
    base = tiny_model_dirs["llama"]
    write_run(tmp_path, base)
    process = start(tmp_path)
    wait_for(lambda: min(checkpoint_step(tmp_path / "out" / n) for n in ("first", "second")) >= 10 or
             process.poll() is not None, timeout=300, what="both jobs to checkpoint")
    assert process.poll() is None, finish(process)
    os.killpg(process.pid, signal.SIGINT)            # Ctrl-C in the terminal
    code, out, err = finish(process)
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
