"""A job's writer on a disk that fills up and frees again: rows that could not be written are kept and
written whole later (never a half row, never a lost one), and failures are counted per kind of file, so
that metric rows that still fit do not hide checkpoints that never do."""

from __future__ import annotations

import errno
import json

from actors.service.outputs.job_files import GENERATIONS_NAME, METRICS_NAME, JobFiles
from tests.helpers.disks import fill


def rows(folder) -> list[dict]:
    text = (folder / METRICS_NAME).read_text()
    assert text == "" or text.endswith("\n"), "a half-written row was left"
    return [json.loads(line) for line in text.splitlines()]


def test_rows_survive_a_full_disk_and_are_written_whole_once_it_frees(small_disks, tmp_path):
    disk = small_disks(tmp_path / "disk", size="64k")
    files = JobFiles("job-a", disk / "job-a", attempts=3)
    files.start([{"step": 1, "loss": 2.0}])
    fill(disk)
    long_row = {"step": 2, "loss": 1.9, "note": "x" * 5000}   # bigger than what is left: a write part-way
    files.append(long_row)
    files.append({"step": 3, "loss": 1.8})
    assert files.failures == {METRICS_NAME: 2} and files.failed is None   # counted, not failed yet
    assert rows(disk / "job-a") == [{"step": 1, "loss": 2.0}]            # no half row on disk
    (disk / "filler").unlink()                                           # the operator frees space
    files.append({"step": 4, "loss": 1.7})
    assert [r["step"] for r in rows(disk / "job-a")] == [1, 2, 3, 4]
    assert rows(disk / "job-a")[1] == long_row
    assert files.failures == {} and files.failed is None
    files.close()


def test_a_disk_that_stays_full_fails_the_job_with_one_reason(small_disks, tmp_path):
    disk = small_disks(tmp_path / "disk", size="64k")
    files = JobFiles("job-b", disk / "job-b", attempts=3)
    files.start([])
    fill(disk)
    for step in range(1, 4):
        files.append({"step": step, "loss": 1.0})
    reason = files.failed
    assert reason is not None
    assert str(disk / "job-b") in reason and "No space left" in reason and "3 attempts" in reason
    assert "aspen resume" in reason
    files.close()


def test_failures_are_counted_per_kind(tmp_path):
    """Metric rows keep fitting while every checkpoint fails: the checkpoint's count is not reset by the
    rows, so the job fails after `attempts` checkpoints."""
    files = JobFiles("job-c", tmp_path / "job-c", attempts=3)
    files.start([])
    full = OSError(errno.ENOSPC, "No space left on device")
    for step in range(1, 4):
        files.append({"step": step, "loss": 1.0})   # fits
        assert files.failed is None
        files.failed_write(full, "checkpoint")
    assert files.failed is not None and "No space left" in files.failed
    files.succeeded("checkpoint")
    assert files.failed is None and files.failures == {}
    assert [r["step"] for r in rows(tmp_path / "job-c")] == [1, 2, 3]
    files.close()


def generations(folder) -> list[dict]:
    text = (folder / GENERATIONS_NAME).read_text()
    assert text == "" or text.endswith("\n"), "a half-written line was left"
    return [json.loads(line) for line in text.splitlines()]


def sample(n: int) -> dict:
    return {"prompt": f"Q: {n}", "reference": str(n), "prediction": "x" * 5000, "score": 0.0}


def test_generation_rows_survive_a_full_disk_and_a_stuck_one_fails_the_job(small_disks, tmp_path):
    disk = small_disks(tmp_path / "disk", size="64k")
    files = JobFiles("job-g", disk / "job-g", attempts=3)
    files.start([])
    files.append_generations(2, [sample(0)])
    fill(disk)
    files.append_generations(4, [sample(1), sample(2)])   # larger than what is left: kept, counted
    assert files.failures == {GENERATIONS_NAME: 1} and files.failed is None
    assert [(r["step"], r["row"]) for r in generations(disk / "job-g")] == [(2, 0)]
    (disk / "filler").unlink()
    files.append_generations(6, [sample(3)])
    assert [(r["step"], r["row"]) for r in generations(disk / "job-g")] == [(2, 0), (4, 0), (4, 1), (6, 0)]
    assert files.failures == {}
    fill(disk)
    for step in (8, 10, 12):
        files.append_generations(step, [sample(step)])
    assert files.failed is not None and "No space left" in files.failed and str(disk / "job-g") in files.failed
    files.close()


def test_a_resumed_job_keeps_the_generations_up_to_its_checkpoint(tmp_path):
    """Evaluations after the checkpoint it resumes from are run again: their rows go (and a half line a crash
    left), those before stay."""
    folder = tmp_path / "job-r"
    files = JobFiles("job-r", folder)
    files.start([])
    for step in (2, 4, 6):
        files.append_generations(step, [sample(step), sample(step + 1)])
    files.close()
    with open(folder / GENERATIONS_NAME, "a") as handle:
        handle.write('{"step": 8, "row": 0, "predic')   # the crash
    again = JobFiles("job-r", folder)
    again.start([{"step": 4, "loss": 1.0}], step=4)
    assert [(r["step"], r["row"]) for r in generations(folder)] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    again.append_generations(6, [sample(9)])
    assert [(r["step"], r["row"]) for r in generations(folder)][-1] == (6, 0)
    again.close()
