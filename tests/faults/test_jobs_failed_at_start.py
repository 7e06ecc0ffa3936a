"""A run whose jobs failed before their first step (a target module no layer of the base has; `aspen run` refuses
such a file before it starts, so the run here is trained past that check, as the CLI's --in-process trains it):

- `aspen report`: each such job is in the report's table with its state, as the job table has it, beside the jobs
  that trained. It was left out (a job folder without metrics.jsonl was not looked at), and a run whose every job
  failed so was refused as not a run's folder at all ("give a run's output folder");
- `aspen export` of such a job says it has no checkpoint either and how to train it again. It said "(step 0 of
  None)" and to export its last checkpoint with --checkpoint, which then answered that it had none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.interrupted_runs import NO_RAY, write_run


def aspen(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=folder, capture_output=True,
                          text=True, timeout=300, env=NO_RAY)


def failing_at_start(jobs: Path, names: set[str]) -> None:
    """The named jobs' LoRA aimed at a module the base has none of: each fails as it starts, before a step."""
    text, out, job = jobs.read_text().splitlines(), [], None
    for line in text:
        job = line.split("name: ")[1] if "- name: " in line else job
        out.append(line.replace("[q_proj, v_proj]", "[q_prj]") if job in names else line)
    jobs.write_text("\n".join(out) + "\n")


# `aspen run --in-process`'s training and record, without its checks of the jobs file
PAST_THE_CHECKS = ("from pathlib import Path; from actors.service.scheduler.local_run import train_locally; "
                   "from orchestrator.jobs_file import load_run_spec; spec = load_run_spec('jobs.yaml'); "
                   "train_locally(spec, progress=False, record_in=Path(spec.output_dir) / '.aspen')")


def run_past_the_checks(folder: Path) -> None:
    result = subprocess.run([sys.executable, "-c", PAST_THE_CHECKS], cwd=folder, capture_output=True, text=True,
                            timeout=300, env=NO_RAY)
    assert result.returncode == 0, result


def report(folder: Path) -> dict[str, tuple[str | None, int]]:
    """Each job's state and steps as `aspen report --json` has them; `aspen report` (its files) said to succeed."""
    written = aspen(folder, "report", "out")
    assert written.returncode == 0 and "Warning" not in written.stderr, written
    result = aspen(folder, "report", "out", "--json")
    assert result.returncode == 0, result
    return {job["job"]: (job["state"], job["steps"]) for job in json.loads(result.stdout)}


@pytest.mark.long   # ~35 s on 2 cores: a run in its own process, the report twice, two exports
def test_a_job_that_failed_before_its_first_step_is_reported_and_its_export_says_why_none(tmp_path, tiny_model_dirs):
    failing_at_start(write_run(tmp_path, tiny_model_dirs["llama"], steps=5), {"second"})
    run_past_the_checks(tmp_path)
    assert report(tmp_path) == {"first": ("completed", 5), "second": ("failed", 0)}
    assert "| second | 0 | - | - | 0 | failed |" in (tmp_path / "out" / "report.md").read_text()
    export = aspen(tmp_path, "export", "second", "--from", "out")
    assert export.returncode == 2 and not (tmp_path / "second-lora").exists(), export
    assert ("job 'second' is failed (step 0) and has no final adapter" in export.stderr
            and "ended before its first checkpoint, so there is none to export either" in export.stderr
            and "`aspen run` its jobs file" in export.stderr and "None" not in export.stderr
            and "--checkpoint" not in export.stderr), export.stderr
    assert aspen(tmp_path, "export", "first", "--from", "out").returncode == 0   # beside it, the job that trained


@pytest.mark.long   # ~25 s on 2 cores, as above
def test_a_run_whose_every_job_failed_before_a_step_is_reported(tmp_path, tiny_model_dirs):
    failing_at_start(write_run(tmp_path, tiny_model_dirs["llama"], steps=5), {"first", "second"})
    run_past_the_checks(tmp_path)
    assert report(tmp_path) == {"first": ("failed", 0), "second": ("failed", 0)}
    assert (tmp_path / "out" / "report.png").stat().st_size > 0


def test_a_file_where_a_jobs_folder_goes_fails_that_job_saying_so(tmp_path, tiny_model_dirs):
    """Past `aspen run`'s check of the job folders (a job a service took): the job fails as it starts saying that a
    file is in the way, its path and what to do; it said "[Errno 17] File exists: ...; make the folder writable",
    which does not help. The other job trains, and the file is left as it was."""
    from actors.service.scheduler.local_run import train_locally
    from orchestrator.jobs_file import load_run_spec

    jobs = write_run(tmp_path, tiny_model_dirs["llama"], steps=2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "second").write_text("notes\n")
    records = {summary.record.name: summary.record for summary in train_locally(load_run_spec(jobs), progress=False)}
    assert records["first"].state == "completed", records["first"]
    reason = records["second"].reason
    assert records["second"].state == "failed" and "writable" not in reason, reason
    assert f"a file is in the way ({tmp_path / 'out' / 'second'} is a file, not a folder); move or delete" in reason
    assert (tmp_path / "out" / "second").read_text() == "notes\n"
