"""`aspen run` of a two-job jobs file on the tiny model, started, interrupted and finished as a user's terminal would
(tests/faults/test_run_again.py, test_in_process_record.py): the file, the processes, what their folders hold,
and the check that interrupted jobs end as an undisturbed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from orchestrator.jobs_file import load_run_spec
from tests.helpers.service import adapter_tensors, max_relative_difference, write_task_data

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


def interrupt_once_checkpointed(process: subprocess.Popen, folder: Path, *, step: int = 10,
                                signal_number: int = signal.SIGINT) -> tuple[int, str, str]:
    """Wait until both jobs have a checkpoint at `step` or later with the command still running, then interrupt it:
    SIGINT to its whole process group (Ctrl-C in a terminal), another signal to the command alone; (its exit code,
    stdout, stderr)."""
    from tests.helpers.service import wait_for

    wait_for(lambda: min(checkpoint_step(folder / "out" / n) for n in ("first", "second")) >= step or
             process.poll() is not None, timeout=300, what="both jobs to checkpoint")
    assert process.poll() is None, finish(process)
    if signal_number == signal.SIGINT:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal_number)
    return finish(process)


def start_aspen(folder: Path, *args: str) -> subprocess.Popen:
    """`aspen ARGS` in its own process group, as a terminal starts it (its recent runs noted in the folder)."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "ASPEN_RECENT_RUNS": str(folder / "runs.json")})


def aspen(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`aspen ARGS` run to its end (its recent runs noted in the folder)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=folder, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "ASPEN_RECENT_RUNS": str(folder / "runs.json")})


def ctrl_c_once(process: subprocess.Popen, ready, what: str) -> tuple[int, str, str]:
    """Wait until `ready()` with the command still running (`what` names that in the timeout's message), then
    SIGINT to its whole process group (Ctrl-C in a terminal); (its exit code, stdout, stderr)."""
    from tests.helpers.service import wait_for

    wait_for(lambda: ready() or process.poll() is not None, timeout=400, what=what)
    assert process.poll() is None, finish(process)
    os.killpg(process.pid, signal.SIGINT)
    return finish(process)


def table_from(folder: Path, output_dir: Path) -> dict[str, dict]:
    """The jobs as `aspen status --json --from OUTPUT_DIR` shows them, no service running."""
    status = aspen(folder, "status", "--json", "--from", str(output_dir))
    assert status.returncode == 0, status.stderr
    return {job["name"]: job for job in json.loads(status.stdout)}
