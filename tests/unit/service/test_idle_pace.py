"""An idle trainer's tick: a short wait while it has work or had it a moment ago, a long one after a quiet
spell (actors/service/trainer/idle_pace.py), and the trainer loop's own account of having work, through a
job's life on a real loop."""

from __future__ import annotations

import pytest

from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.idle_pace import IdlePace
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_is_short_while_busy_and_long_only_after_a_quiet_spell():
    clock = Clock()
    pace = IdlePace(short_s=0.05, long_s=0.5, quiet_after_s=5.0, clock=clock)
    assert pace.next_wait(busy=False) == 0.05          # just started: as if busy a moment ago
    clock.now += 4.9
    assert pace.next_wait(busy=False) == 0.05
    clock.now += 0.2
    assert pace.next_wait(busy=False) == 0.5           # 5.1 s without work
    assert pace.next_wait(busy=True) == 0.05           # work again: short at once
    clock.now += 4.0
    assert pace.next_wait(busy=False) == 0.05          # measured from the last busy tick, not the first
    clock.now += 1.5
    assert pace.next_wait(busy=False) == 0.5


@pytest.mark.parametrize("short, long", [(0, 0.5), (0.5, 0.05), (-1, 1)])
def test_waits_out_of_order_are_refused(short, long):
    with pytest.raises(ValueError, match="0 < short_s <= long_s"):
        IdlePace(short_s=short, long_s=long)


def test_a_loop_has_work_from_an_assignment_until_its_job_has_left(tmp_path, tiny_base, tiny_model_dirs):
    job = job_dict("one", write_task_data(tmp_path / "data", "one"), 3)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job])
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model), "trainer-t", tmp_path / "state")
    assert not loop.has_work()
    loop.assign(assignment_for(spec.submissions()[0], "one-1", tiny_base.tokenizer))
    assert loop.has_work()                              # queued, not yet taken at a step boundary
    assert loop.run_once(idle_wait=0) is not None
    assert loop.has_work()                              # training
    events = run_until_idle(loop)
    assert any(e.kind == "completed" for e in events)
    assert not loop.has_work()                          # ended and gone: the trainer may slow its ticks
