"""A job's writer on a disk that fills up and frees again: rows that could not be written are kept and
written whole later (never a half row, never a lost one), and failures are counted per kind of file, so
that metric rows that still fit do not hide checkpoints that never do."""

from __future__ import annotations

import errno
import json

from actors.service.outputs.job_files import METRICS_NAME, JobFiles
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
