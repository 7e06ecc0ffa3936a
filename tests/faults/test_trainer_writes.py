"""A trainer's own writes on a disk that fills up: a leaving job's final write tried again succeeds once space
frees (and fails with the disk's error when it never does), and the step log goes on past a full disk
without raising, warning once (its rows are not all whole then: a known defect, marked)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from actors.service.scheduler.retries import with_retries
from actors.service.trainer.step_log import StepLog
from tests.helpers.disks import fill


def test_a_final_write_on_a_full_disk_succeeds_once_space_frees(small_disks, tmp_path):
    disk = small_disks(tmp_path / "disk", size="64k")
    fill(disk)
    failures = []

    def operator_frees_space(error: OSError, tries: int, last: bool) -> None:
        failures.append((error.errno, tries, last))
        (disk / "filler").unlink()

    payload = b"\1" * 8192
    with_retries(lambda: (disk / "adapter.bin").write_bytes(payload), backoff_s=(0.0,),
                 on_failure=operator_frees_space)
    assert failures == [(errno.ENOSPC, 1, False)]
    assert (disk / "adapter.bin").read_bytes() == payload


def test_a_final_write_on_a_disk_that_stays_full_fails_with_its_error(small_disks, tmp_path):
    disk = small_disks(tmp_path / "disk", size="64k")
    fill(disk)
    failures = []
    with pytest.raises(OSError) as raised:
        with_retries(lambda: (disk / "adapter.bin").write_bytes(b"\1" * 8192), attempts=3, backoff_s=(0.0,),
                     on_failure=lambda error, tries, last: failures.append((tries, last)))
    assert raised.value.errno == errno.ENOSPC
    assert failures == [(1, False), (2, False), (3, True)]


def write_past_a_full_disk(small_disks, tmp_path) -> tuple[Path, StepLog]:
    """A step log whose disk fills after its first row, is refused big rows, then frees (its last row)."""
    disk = small_disks(tmp_path / "disk", size="64k")
    steps = StepLog(disk / "trainers" / "trainer-0.jsonl", "trainer-0")
    steps.write({"step": 1, "loss": 2.0})
    fill(disk)
    for step in range(2, 8):   # rows far bigger than a page: the disk refuses them
        steps.write({"step": step, "loss": 1.0, "sequence_lengths": [4096] * 2000})
    (disk / "filler").unlink()   # the operator frees space
    steps.write({"step": 8, "loss": 0.5})
    steps.close()
    return disk / "trainers" / "trainer-0.jsonl", steps


def test_the_step_log_goes_on_past_a_full_disk_warning_once(small_disks, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="actors.service.trainer.step_log"):
        path, steps = write_past_a_full_disk(small_disks, tmp_path)   # raises nothing
    warnings = [r.getMessage() for r in caplog.records if "cannot write its step log" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0] and "No space left" in warnings[0]
    assert not steps.failing
    text = path.read_text()
    assert text.startswith('{"step": 1, ') and text.endswith('{"step": 8, "loss": 0.5}\n')


def test_the_step_log_keeps_only_whole_rows_past_a_full_disk(small_disks, tmp_path):
    path, _ = write_past_a_full_disk(small_disks, tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    numbers = [row["step"] for row in rows]
    assert numbers[0] == 1 and numbers[-1] == 8 and numbers == sorted(set(numbers))
