"""Driving a TrainerLoop without Ray: assignments, running it until idle, fake trainer statuses."""

from __future__ import annotations

import random
import time
from pathlib import Path

from actors.service.scheduler.job_data import JobData
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.service.trainer.trainer_reports import TrainerStatus


def assignment_for(submission, job_id: str, tokenizer) -> Assignment:
    data = JobData(job_id, submission, tokenizer)
    summary = data.prepare()
    return Assignment(job_id=job_id, submission=submission, output_dir=Path(submission.output_dir), data=summary,
                      eval_examples=data.eval_examples(), link=LocalJobLink(data))


def run_until_idle(loop: TrainerLoop, limit: int = 500) -> list:
    events = []
    for _ in range(limit):
        loop.run_once(idle_wait=0.05 if loop.leaving and not loop.active else 0)   # uploads wake it
        events += loop.drain_events()
        if not loop.active and not loop.leaving and loop.commands.empty():
            return events
    raise AssertionError("the trainer loop did not finish its jobs")


def fake_status(trainer_id: str, base_model: str, budget: int = 10 * 2**30, jobs=()) -> TrainerStatus:
    return TrainerStatus(trainer_id=trainer_id, incarnation="x", base_model=base_model, quantization="none",
                         device="cpu", jobs=list(jobs), steps=0, tokens=0, padding_tokens=0, busy_seconds=0.0,
                         started_at=time.time(), base_bytes=100 * 2**20, peak_memory_bytes=0,
                         memory_budget_bytes=budget, activation_bytes_estimate=50 * 2**20,
                         linear_shapes={"model.layers.0.self_attn.q_proj": (64, 64),
                                        "model.layers.0.self_attn.v_proj": (64, 32)})


class LateVerdicts:
    """A job link whose answers to loss updates arrive late (as from a busy job actor): each after a
    random delay; the data itself comes at once."""

    def __init__(self, data: JobData, seed: int, longest_s: float = 0.15):
        self.inner = LocalJobLink(data)
        self.random = random.Random(seed)
        self.longest_s = longest_s

    def fetch(self, position, count):
        return self.inner.fetch(position, count)

    def update(self, update):
        return LatePending(self.inner.update(update).result(), self.random.uniform(0, self.longest_s))


class LatePending:
    def __init__(self, value, delay: float):
        self.value, self.ready_at = value, time.monotonic() + delay

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at

    def wait(self, timeout: float) -> bool:
        time.sleep(max(0.0, min(timeout, self.ready_at - time.monotonic())))
        return self.done()

    def result(self):
        self.wait(self.ready_at - time.monotonic())
        return self.value
