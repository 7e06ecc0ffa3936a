"""Jobs their trainer stopped holding without reporting their end (actors/service/scheduler/held_jobs.py), over a
real job table and scheduler core: queued again from their checkpoints after two of the trainer's answers in a
row left them out, and only those: a job not picked up yet, one listed again, one that ended by an event, one of
an earlier incarnation of the trainer and an interactive model are left alone."""

from __future__ import annotations

import dataclasses
import logging

from actors.service.scheduler.held_jobs import MISSED_POLLS, HeldJobs, give_back_unheld
from actors.service.trainer.trainer_reports import TrainerEvent
from tests.helpers.scheduler_fakes import running_jobs, status

TRAINER = "trainer-0"


def answers(held, core, *listed_each, skip=lambda job_id: False) -> list[list[str]]:
    """One `give_back_unheld` per answer of the trainer (each a new status listing those jobs): what each gave back."""
    return [give_back_unheld(held, core.booking, [status(TRAINER, jobs)], skip) for jobs in listed_each]


def test_a_listed_job_the_trainer_drops_without_an_end_is_queued_again_from_its_checkpoint(tmp_path, caplog):
    table, core, (a, b) = running_jobs(tmp_path)
    with table.transaction():
        core.apply_event(TRAINER, TrainerEvent(kind="checkpoint", job_id=a, step=4, data={}))
    held = HeldJobs()
    assert MISSED_POLLS == 2
    with caplog.at_level(logging.ERROR):
        assert answers(held, core, [a, b], [b], [b]) == [[], [], [a]]
    record = table.get(a)
    assert record.state == "queued" and record.trainer is None and record.checkpoint_step == 4
    assert "stopped holding it without reporting its end" in record.reason and "retry 1 of" in record.reason
    assert "no longer holds it and reported no end" in caplog.text
    assert table.get(b).state == "running"
    assert core.scheduling.of(a).replace_job_actor   # a new job actor: the old one's link was the trainer's
    assert answers(held, core, [b], [b]) == [[], []]   # given back once


def test_a_job_not_yet_listed_or_listed_again_or_ended_by_its_event_stays(tmp_path):
    table, core, (a, b) = running_jobs(tmp_path)
    held = HeldJobs()
    assert answers(held, core, [], [], [], []) == [[]] * 4          # assigned, not picked up yet: never listed
    assert answers(held, core, [a, b], [b], [a, b], [b]) == [[]] * 4   # one miss, listed again: the count starts over
    with table.transaction():   # its end reported: booked before the answer that no longer lists it
        core.apply_event(TRAINER, TrainerEvent(kind="completed", job_id=b, step=10, data={"reason": "done"}))
    assert answers(held, core, [a], [a], [a]) == [[]] * 3
    assert table.get(b).state == "completed"


def test_the_same_answer_read_again_counts_once(tmp_path):
    table, core, (a, b) = running_jobs(tmp_path)
    held = HeldJobs()
    give_back_unheld(held, core.booking, [status(TRAINER, [a, b])], lambda job_id: False)
    missing = status(TRAINER, [b])
    for _ in range(5):   # the scheduler ticks faster than the trainer answers: one answer, one miss
        assert give_back_unheld(held, core.booking, [missing], lambda job_id: False) == []
    assert table.get(a).state == "running"


def test_a_new_incarnation_of_the_trainer_and_skipped_jobs_are_left_to_their_own_paths(tmp_path):
    """A replaced trainer's jobs are queued by the fleet (`trainer_lost`); jobs on their way to a trainer and
    interactive models (which leave through their front) are the caller's to skip."""
    table, core, (a, b) = running_jobs(tmp_path)
    held = HeldJobs()
    answers(held, core, [a, b])
    replaced = dataclasses.replace(status(TRAINER, []), incarnation="y")
    for _ in range(3):
        assert give_back_unheld(held, core.booking, [dataclasses.replace(replaced)], lambda job_id: False) == []
    held = HeldJobs()
    assert answers(held, core, [a, b], [], [], [], skip=lambda job_id: True) == [[]] * 4
    assert table.get(a).state == table.get(b).state == "running"


def test_a_job_started_again_on_the_same_trainer_must_be_listed_anew(tmp_path):
    """Given back, then placed on the same trainer: until that trainer picks it up at its next boundary, its
    absence from the list is not a miss."""
    table, core, (a, b) = running_jobs(tmp_path)
    held = HeldJobs()
    assert answers(held, core, [a, b], [b], [b]) == [[], [], [a]]
    with table.transaction():
        assert [s.job for s in core.plan([status(TRAINER, [b])])] == [a]
    assert table.get(a).state == "running"
    assert answers(held, core, [b], [b], [b]) == [[]] * 3
    with table.transaction():
        core.apply_event(TRAINER, TrainerEvent(kind="started", job_id=a, step=4, data={"resumed_from": 4}))
    assert answers(held, core, [a, b], [b], [b]) == [[], [], [a]]   # listed, then dropped again: given back again
    assert "retry 2 of" in table.get(a).reason
