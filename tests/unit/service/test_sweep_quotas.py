"""A sweep and its user's quotas (actors/service/scheduler/quotas.py), over the real scheduler core, job table and
users file: a sweep whose first trial the quota refuses is refused as that job is (the scheduler's QuotaExceeded,
with retry_after; nothing entered, no sweep made), and a later trial the quota refuses mid-sweep is not lost: it
waits, pending, the sweep's status saying why, and is submitted once the quota lets it in."""

from __future__ import annotations

import pytest

from actors.service.scheduler.scheduler_core import QuotaExceeded
from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.spec.job_submission import JobSubmission
from actors.spec.sweep_spec import SweepSpec
from tests.helpers.service import alice_with_quotas, job_dict


def _sweep(name: str, data, state) -> SweepSpec:   # under alice's own outputs, as a shared service has it
    return SweepSpec(name=name, output_dir=str(state / "outputs" / "alice" / name), user="alice", search="grid",
                     max_concurrent=2, job=job_dict("qa", data, 8, eval_split=4, eval_every=2),
                     space={"lr": {"choice": [1e-3, 1e-2]}})


def test_a_sweep_over_its_users_quota_is_refused_and_a_later_trial_over_it_waits(tmp_path):
    core, table, users, data, state = alice_with_quotas(tmp_path, {"queued": 1}, policy="fifo")
    book = SweepBook(state, SchedulerJobs(core, table, cancel=lambda job_id, reason: None))

    # her one queued place is taken: the sweep's first trial would be refused, so is the sweep (as a job is)
    held = core.submit(JobSubmission(job=job_dict("other", data, 5), user="alice"))
    with pytest.raises(QuotaExceeded) as refused:
        book.add(_sweep("early", data, state))
    with pytest.raises(QuotaExceeded) as as_a_job:   # the reference: the same job submitted alone
        core.submit(JobSubmission(job=job_dict("qa-t0", data, 8), user="alice"))
    assert refused.value.retry_after == as_a_job.value.retry_after == 30
    assert str(refused.value).startswith("nothing was started: the sweep's first trial 'qa-t0' is over its user's "
                                         "quota: user alice: quota queued=1: 1 of their jobs are queued")
    assert "early" not in book.drivers and [r.name for r in table.all()] == ["other"]

    # with her place free the sweep is taken; its second trial finds the first one queued: it waits, not failed
    table.set_state(held.id, "cancelled", "cancelled by the user")
    book.add(_sweep("later", data, state))
    book.poll_all()
    status = book.status("later")
    assert [(t["name"], t["state"]) for t in status["trials"]] == [("qa-t0", "running"), ("qa-t1", "pending")]
    assert status["state"] == "running" and status["error"] is None
    assert status["waiting"].startswith("qa-t1: user alice: quota queued=1: 1 of their jobs are queued"), status
    assert [r.name for r in table.all()] == ["other", "qa-t0"]
    book.poll_all()   # still over it: still waiting, nothing entered
    assert [r.name for r in table.all()] == ["other", "qa-t0"] and book.status("later")["waiting"] is not None

    first = next(r for r in table.all() if r.name == "qa-t0")
    table.set_state(first.id, "running", "training")   # her queued job started: her place is free
    book.poll_all()
    status = book.status("later")
    assert [(t["name"], t["state"]) for t in status["trials"]] == [("qa-t0", "running"), ("qa-t1", "running")]
    assert status["waiting"] is None and [r.name for r in table.all()] == ["other", "qa-t0", "qa-t1"]
    table.close()
