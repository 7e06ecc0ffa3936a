"""`aspen run --in-process` recorded where `aspen run` keeps its jobs (`<output_dir>/.aspen/jobs.sqlite`):

- once it ended, `aspen run` of the same file finds its jobs done (answering without Ray, with the table the run
  ended with), `aspen report` shows their states, `aspen status` answers from its table; run in-process again, it
  plans as `aspen run` does: done jobs left alone (no model loaded, the same table), a changed one refused, started
  over with --overwrite and only it;
- while a service (or another run) holds the folder, it refuses before anything is deleted, exit 1, saying who
  holds it and what to do;
- Ctrl-C checkpoints its running jobs and records them paused: `aspen run` (through a service) or the same command
  resumes them, and they end as an undisturbed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from actors.service.table.state_dir import lock_state_dir
from orchestrator.jobs_file import load_run_spec
from tests.helpers.interrupted_runs import (
    NO_RAY,
    STEPS,
    assert_like_undisturbed,
    checkpoint_step,
    finish,
    interrupt_once_checkpointed,
    metric_steps,
    run,
    write_run,
)
from tests.helpers.service import wait_for

CLUSTER_SEARCH = Path(__file__).resolve().parents[1] / "helpers" / "cli_cluster_search.py"


def in_process(folder: Path, env: dict[str, str] | None = None, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "--quiet", "jobs.yaml",
                             *args],
                            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def aspen(folder: Path, *args: str, env: dict[str, str] | None = None, no_cluster: bool = False
          ) -> subprocess.CompletedProcess:
    """`aspen ARGS`; with no_cluster as on a machine where Ray finds no running cluster (the test workers run theirs
    beside each other: tests/helpers/cli_cluster_search.py)."""
    command = [str(CLUSTER_SEARCH)] if no_cluster else ["-m", "orchestrator.cli"]
    return subprocess.run([sys.executable, *command, *args], cwd=folder, capture_output=True, text=True, timeout=300,
                          env=env)


def report_states(folder: Path) -> dict[str, tuple[str, int]]:
    result = aspen(folder, "report", "out", "--json")
    assert result.returncode == 0, result.stderr
    return {job["job"]: (job["state"], job["steps"]) for job in json.loads(result.stdout)}


def end_table(out: str) -> list[str]:
    """The jobs' table `aspen run` ends with: its title and rows (rich's box lines), one string a line."""
    return [line.strip() for line in out.splitlines() if line.strip().startswith(("│", "┃")) or " jobs on " in line]


@pytest.mark.long
def test_a_finished_in_process_run_is_what_aspen_run_report_and_status_find(tmp_path, tiny_model_dirs):
    write_run(tmp_path, tiny_model_dirs["llama"], steps=20)
    env = {**NO_RAY, "ASPEN_RECENT_RUNS": str(tmp_path / "runs.json")}
    code, out, err = finish(in_process(tmp_path, env))
    assert code == 0, err
    assert report_states(tmp_path) == {"first": ("completed", 20), "second": ("completed", 20)}
    trained = end_table(out)
    assert sum("completed" in line and "20/20" in line for line in trained) == 2, out
    # the service's way reads the table first: every job done, so it answers without Ray (none answers there),
    # and ends with the same table as the run that trained them
    code, out, err = run(tmp_path, env=env)
    assert code == 0, err
    assert "first: already completed at step 20; left alone" in out and "second: already completed" in out, out
    assert end_table(out) == trained, (out, trained)
    # no cluster named, and none found on the machine (the other test workers' clusters left out of Ray's search)
    status = aspen(tmp_path, "status", env={k: v for k, v in env.items() if k != "RAY_ADDRESS"}, no_cluster=True)
    assert status.returncode == 0 and "the job table of the run in" in status.stderr, status.stderr
    assert status.stdout.count("completed") == 2, status.stdout
    # `aspen extend` of one of its jobs, with no service: says how that run continues it
    extend = aspen(tmp_path, "extend", "first", "--max-steps", "30",
                   env={k: v for k, v in env.items() if k != "RAY_ADDRESS"}, no_cluster=True)
    assert extend.returncode != 0 and (f"job 'first' is of the `aspen run` of {tmp_path / 'jobs.yaml'}, which has "
                                       "ended: set its max_steps to 30 there") in extend.stderr, extend.stderr
    # again in-process: every job done, so left alone (their files untouched), answered from the table
    adapters = {name: (tmp_path / "out" / name / "adapter_model.safetensors").stat().st_mtime_ns
                for name in ("first", "second")}
    code, out, err = finish(in_process(tmp_path, env))
    assert code == 0, err
    assert "first: already completed at step 20; left alone" in out and "second: already completed" in out, out
    assert end_table(out) == trained, (out, trained)
    assert {name: (tmp_path / "out" / name / "adapter_model.safetensors").stat().st_mtime_ns
            for name in ("first", "second")} == adapters
    jobs = (tmp_path / "jobs.yaml").read_text()
    # one job's learning rate changed: refused, nothing touched; with --overwrite that job alone starts over
    (tmp_path / "jobs.yaml").write_text(jobs.replace("lr: 1.0e-3\n    max_steps", "lr: 2.0e-3\n    max_steps", 1))
    code, out, err = finish(in_process(tmp_path, env))
    assert code == 2 and "job 'first': lr: 0.001 -> 0.002" in err and "--overwrite" in err, (code, out, err)
    # with --overwrite and a bad row in its data: refused before anything is deleted, and not said to be (it was:
    # "first: started over (--overwrite ...); its earlier results are deleted", then the refusal, the files kept)
    data = (tmp_path / "data" / "first.jsonl").read_text()
    (tmp_path / "data" / "first.jsonl").write_text(data + '{"question": "cut short"\n')
    code, out, err = finish(in_process(tmp_path, env, "--overwrite"))
    assert code == 2 and "first.jsonl:33: invalid JSON" in err and "nothing was started" in err, (code, out, err)
    assert "deleted" not in out and "started over" not in out, out
    assert {name: (tmp_path / "out" / name / "adapter_model.safetensors").stat().st_mtime_ns
            for name in ("first", "second")} == adapters
    (tmp_path / "data" / "first.jsonl").write_text(data)
    code, out, err = finish(in_process(tmp_path, env, "--overwrite"))
    assert code == 0, err
    assert "first: started over (--overwrite" in out and "second: already completed at step 20" in out, out
    assert (tmp_path / "out" / "first" / "adapter_model.safetensors").stat().st_mtime_ns > adapters["first"]
    assert (tmp_path / "out" / "second" / "adapter_model.safetensors").stat().st_mtime_ns == adapters["second"]
    assert report_states(tmp_path) == {"first": ("completed", 20), "second": ("completed", 20)}
    assert metric_steps(tmp_path / "out" / "first") == list(range(1, 21))


def test_an_in_process_run_leaves_a_folder_a_service_writes_to_alone(tmp_path, tiny_model_dirs):
    write_run(tmp_path, tiny_model_dirs["llama"], steps=20)
    (tmp_path / "out" / "first").mkdir(parents=True)
    kept = tmp_path / "out" / "first" / "metrics.jsonl"
    kept.write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "out" / ".aspen").mkdir()
    held = lock_state_dir(tmp_path / "out" / ".aspen")   # as the service of an `aspen run` holds it
    try:
        code, out, err = finish(in_process(tmp_path, NO_RAY))
    finally:
        held.close()
    assert code == 1, (code, out, err)
    assert f"another aspen run or service is writing to {tmp_path / 'out'} (pid {os.getpid()} on" in err, err
    assert "nothing was changed there" in err and "--output-dir" in err and "Traceback" not in err, err
    assert kept.read_text() == '{"step": 1, "loss": 2.0}\n'   # its job folders untouched
    assert not (tmp_path / "out" / "second").exists()


@pytest.mark.long
@pytest.mark.parametrize("again", ["service", "in-process"])
def test_ctrl_c_in_process_then_the_run_again_resumes_the_jobs_as_if_undisturbed(tmp_path, tiny_model_dirs, again):
    """Ctrl-C to `aspen run --in-process`, then `aspen run` (a service) or the same command again: each job resumes
    from its checkpoint, its metrics one row a step, its adapter as an undisturbed run's."""
    base = tiny_model_dirs["llama"]
    write_run(tmp_path, base)
    code, out, err = interrupt_once_checkpointed(in_process(tmp_path), tmp_path)   # Ctrl-C in the terminal
    assert code == 130, (code, out, err)
    assert "the running jobs were checkpointed, and the same command continues" in err and "Traceback" not in err
    stopped = {name: checkpoint_step(tmp_path / "out" / name) for name in ("first", "second")}
    assert all(10 <= step < STEPS for step in stopped.values()), stopped
    assert report_states(tmp_path) == {name: ("paused", stopped[name]) for name in stopped}
    code, out, err = run(tmp_path) if again == "service" else finish(in_process(tmp_path))
    assert code == 0, err
    assert "first: unfinished in the last run" in out and f"from its checkpoint at step {stopped['first']}" in out, out
    for name in ("first", "second"):
        assert metric_steps(tmp_path / "out" / name) == list(range(1, STEPS + 1))
    assert_like_undisturbed(tmp_path, base)


def test_ctrl_c_inside_train_locally_is_held_until_the_round_that_runs_has_ended(tmp_path, tiny_model_dirs):
    """A script's or a notebook's Ctrl-C while `train_locally` steps (the main thread, Python's own handler): held
    until the round that runs has ended, then raised between rounds (not inside a step, where it left the jobs half
    updated when they were checkpointed); Python's handler is back afterwards; the jobs' checkpoints are at the last
    step their metrics show."""
    base = tiny_model_dirs["llama"]
    write_run(tmp_path, base)
    spec = load_run_spec(tmp_path / "jobs.yaml")
    started = threading.Event()
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))

    def on_step(report) -> None:
        if not started.is_set():
            started.set()
            timer.start()   # lands anywhere in a later round

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        with pytest.raises(KeyboardInterrupt) as interrupted:
            train_locally(spec, base=load_base_model(str(base), dtype="float32", device="cpu"), progress=False,
                          on_step=on_step)
    finally:
        timer.cancel()
    raised_in = traceback.extract_tb(interrupted.value.__traceback__)[-1]
    assert raised_in.name == "check" and raised_in.filename.endswith("local_run.py"), raised_in
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for name in ("first", "second"):
        steps = metric_steps(tmp_path / "out" / name)
        assert 0 < checkpoint_step(tmp_path / "out" / name) == steps[-1] < STEPS, (name, steps[-3:])


@pytest.mark.long
def test_ctrl_c_to_a_pipeline_run_in_process_stops_its_stages_between_steps(tmp_path, tiny_model_dirs):
    """`stages: 2` in process: the terminal's Ctrl-C reaches the stage processes too (one process group). They leave
    it to the run's process, which stops them between steps: exit 130, the jobs checkpointed and recorded paused (a
    stage that died at the signal lost the pipeline: exit 1, 'pipeline stage lost', nothing recorded)."""
    jobs = write_run(tmp_path, tiny_model_dirs["llama"])
    jobs.write_text("stages: 2\n" + jobs.read_text())
    code, out, err = interrupt_once_checkpointed(in_process(tmp_path), tmp_path)
    assert code == 130, (code, out, err)
    assert "stage lost" not in err and "Traceback" not in err and "the running jobs were checkpointed" in err, err
    states = report_states(tmp_path)
    assert {state for state, _ in states.values()} == {"paused"}, states
    assert all(checkpoint_step(tmp_path / "out" / name) == states[name][1] for name in states), states


def _stage_processes(parent: int) -> list[int]:
    """The pipeline's stage processes a run started: the children of its multiprocessing fork server (itself a child
    of the run's process; actors/service/pipeline/pipeline_processes.py `stage_context`)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        processes[int(entry.name)] = (ppid, command)
    servers = {pid for pid, (ppid, command) in processes.items()
               if ppid == parent and b"multiprocessing.forkserver" in command}
    return [pid for pid, (ppid, _) in processes.items() if ppid in servers]


@pytest.mark.long
def test_a_step_that_hangs_is_left_at_the_second_ctrl_c(tmp_path, tiny_model_dirs):
    """The first Ctrl-C waits for the step that runs to end; where it never ends (here a stage process stopped
    with SIGSTOP mid-run), the second ends the run at once: exit 130, one line saying the jobs keep their last
    checkpoints, which are whole (written between steps) and recorded as left unfinished."""
    jobs = write_run(tmp_path, tiny_model_dirs["llama"])
    jobs.write_text("stages: 2\n" + jobs.read_text())
    process = in_process(tmp_path)
    stages: list[int] = []
    try:
        wait_for(lambda: checkpoint_step(tmp_path / "out" / "first") >= 10 or process.poll() is not None,
                 timeout=300, what="a checkpoint")
        assert process.poll() is None, finish(process)
        stages = _stage_processes(process.pid)
        assert len(stages) == 1, stages
        os.kill(stages[0], signal.SIGSTOP)   # the pipeline's next step never ends
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(1.0)
        assert process.poll() is None, "the first Ctrl-C did not wait for the step"
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=60)   # its output is read below: the stopped stage holds the pipes open
    finally:
        for pid in stages:
            os.kill(pid, signal.SIGKILL)
    out, err = process.communicate(timeout=60)
    assert code == 130, (code, out, err)
    assert "stopping once the step that runs has ended" in err and "stopped at once" in err, err
    assert "keep their last checkpoints" in err and "Traceback" not in err, err
    for name in ("first", "second"):
        state = json.loads((tmp_path / "out" / name / "checkpoint" / "state.json").read_text())
        assert 10 <= state["step"] < STEPS, state
    assert {state for state, _ in report_states(tmp_path).values()} == {"paused"}


@pytest.mark.long
def test_a_run_killed_on_the_way_leaves_no_earlier_record_of_its_jobs(tmp_path, tiny_model_dirs):
    """An in-process run that ended (its jobs recorded completed), then the same run again, killed outright
    (SIGKILL: no handler runs): the table does not still say the jobs are done, while their folders hold the new
    run's checkpoints; they are recorded as left unfinished (`aspen run` resumes them)."""
    write_run(tmp_path, tiny_model_dirs["llama"], steps=5)   # its last checkpoint at 5: the wait below is the next
    code, out, err = finish(in_process(tmp_path))
    assert code == 0, err
    assert report_states(tmp_path) == {"first": ("completed", 5), "second": ("completed", 5)}
    write_run(tmp_path, tiny_model_dirs["llama"])   # STEPS this time: changed, so started over with --overwrite
    process = in_process(tmp_path, None, "--overwrite")
    wait_for(lambda: checkpoint_step(tmp_path / "out" / "first") >= 10 or process.poll() is not None,
             timeout=300, what="a checkpoint")
    os.killpg(process.pid, signal.SIGKILL)
    finish(process)
    assert {state for state, _ in report_states(tmp_path).values()} == {"paused"}


def test_a_damaged_table_in_the_run_folder_costs_the_record_not_the_run(tmp_path, tiny_model_dirs):
    """The run folder's job table overwritten with garbage: the run trains (exit 0, the adapters there) and says
    once that its jobs could not be recorded, with the table's own message (its backup, the commands that restore
    it); the garbage is left for the user to move as that message says."""
    write_run(tmp_path, tiny_model_dirs["llama"], steps=5)
    table = tmp_path / "out" / ".aspen" / "jobs.sqlite"
    table.parent.mkdir(parents=True)
    garbage = os.urandom(3000)
    table.write_bytes(garbage)
    code, out, err = finish(in_process(tmp_path))
    assert code == 0, err
    assert all((tmp_path / "out" / name / "adapter_model.safetensors").is_file() for name in ("first", "second"))
    assert err.count("could not be recorded in") == 1 and f"the job table {table} is damaged" in err, err
    assert table.read_bytes() == garbage


WATCHER_AFTER_THE_STEPS_LEFT = """
import os, signal, sys, time
from actors.service.scheduler.local_run import StopBetweenSteps
from orchestrator.cli.run_commands import _watch_stops
stops = StopBetweenSteps()
stops.began = True   # steps ran; the main thread already left them (stepping False) to checkpoint the jobs
signal.signal(signal.SIGINT, lambda signum, frame: None)   # the main thread's own handling is not under test
_watch_stops(stops)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(2.0)
"""


def test_the_first_ctrl_c_is_answered_also_when_the_main_thread_left_the_steps_first():
    """The race behind a flaky run of the test above: the first Ctrl-C raised at the top of a round, the main thread
    out of the steps (checkpointing the jobs) before the watcher thread read the signal; the watcher still says the
    run is stopping (it said nothing, and the user saw no answer until a second Ctrl-C)."""
    done = subprocess.run([sys.executable, "-c", WATCHER_AFTER_THE_STEPS_LEFT], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("stopping once the step that runs has ended") == 1, done.stderr


def test_status_of_an_in_process_run_still_going_says_so_not_as_it_ended(tmp_path, tiny_model_dirs):
    """`aspen status --from` (or without a service, the newest run's folder) while an in-process run trains there:
    the table is said to be as that run last recorded it, naming the process still going and where its steps so
    far are, not "as it ended" (it was, with its jobs shown paused at step 0 while they trained); once the run has
    stopped, as it ended."""
    write_run(tmp_path, tiny_model_dirs["llama"])
    process = in_process(tmp_path, NO_RAY)
    wait_for(lambda: (tmp_path / "out" / "first" / "metrics.jsonl").is_file() or process.poll() is not None,
             timeout=300, what="the run's first step")
    status = aspen(tmp_path, "status", "--from", "out", env=NO_RAY)
    running = process.poll() is None
    code, _, err = interrupt_once_checkpointed(process, tmp_path)
    assert code == 130 and running, err
    assert status.returncode == 0 and "as it ended" not in status.stderr, status.stderr
    assert (f"the job table of the run in out, which is still going (pid {process.pid} on " in status.stderr
            and "`aspen report out`" in status.stderr), status.stderr
    ended = aspen(tmp_path, "status", "--from", "out", env=NO_RAY)
    assert ended.returncode == 0 and "the job table of the run in out as it ended" in ended.stderr, ended.stderr
