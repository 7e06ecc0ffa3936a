"""A trainer's record of its fused steps: one row per step in its step log (read by reports), and the totals
its status reports. A disk that refuses a row costs the row, never a job."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.engine.step_report import StepReport
from actors.storage.durable import append_whole

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StepTotals:
    """What a trainer's fused steps added up to since it started (`incarnation`: this start's id)."""

    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started_at: float = field(default_factory=time.time)
    busy_seconds: float = 0.0     # time in fused steps
    tokens: int = 0
    padding_tokens: int = 0
    peak_memory: int = 0          # the highest step peak so far (on a CPU the process's resident peak)
    longest_sequence: int = 0
    data_waits: int = 0           # times a step waited for a job's data

    def add(self, report: StepReport) -> None:
        self.busy_seconds += report.seconds
        self.tokens += report.tokens
        self.padding_tokens += report.padding_tokens
        peak = report.peak_memory_bytes
        if report.resident_peak_bytes is not None:
            # on a CPU the process's peak: what ran between steps (a job's export, its start) counts against the
            # budget too (imported here: the scheduler reads this module's paths and imports no torch)
            from actors.engine.memory import process_peak_resident_bytes

            peak = max(report.resident_peak_bytes, process_peak_resident_bytes())
        self.peak_memory = max(self.peak_memory, peak)
        self.longest_sequence = max([self.longest_sequence, *report.sequence_lengths])


class StepLog:
    """The trainer's step rows, appended to `path` (JSON lines)."""

    def __init__(self, path: Path, trainer_id: str):
        self.path = path
        self.trainer_id = trainer_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        self.failing = False   # the last row could not be written (warned once until one is)

    def write(self, row: dict[str, Any]) -> None:
        try:
            append_whole(self.fd, (json.dumps(row) + "\n").encode())   # a row the disk cuts is taken back whole
        except OSError as error:
            if not self.failing:
                log.warning("trainer %s: cannot write its step log %s (%s); training goes on, rows are lost "
                            "until it can", self.trainer_id, self.path, error)
            self.failing = True
            return
        self.failing = False

    def close(self) -> None:
        os.close(self.fd)
