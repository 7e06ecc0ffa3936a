"""A user's quotas at submit (actors/service/scheduler/quotas.py) on a real job table and users file: past a quota
the refusal is a QuotaExceeded (not a plain SubmissionError), nothing entered, and its retry_after for the daily
tokens is when enough of the user's step rows are 24 hours old, computed here from the rows' own times."""

from __future__ import annotations

import time

import pytest

from actors.service.scheduler.scheduler_core import QuotaExceeded, SubmissionError
from actors.spec.job_submission import JobSubmission
from tests.helpers.service import alice_with_quotas, job_dict


def test_spent_daily_tokens_say_when_enough_of_them_are_a_day_old(tmp_path):
    core, table, book, data, state = alice_with_quotas(tmp_path, {"tokens_per_day": 1000})
    job = core.submit(JobSubmission(job=job_dict("first", data, 5), user="alice")).id
    now = time.time()
    for step, (age_h, tokens) in enumerate([(30, 5000), (20, 400), (10, 500), (2, 300)], start=1):
        table.progress.add(job, {"step": step, "loss": 1.0, "tokens": tokens})   # 1200 over the last 24 hours
        with table.transaction():
            table.db.execute("UPDATE progress SET time = ? WHERE job_id = ? AND step = ?",
                             (now - age_h * 3600, job, step))
    with pytest.raises(QuotaExceeded) as refused:
        core.submit(JobSubmission(job=job_dict("second", data, 5), user="alice"))
    # the 400 tokens of 20 hours ago leave the last 24 hours in 4 hours: 800 left, under the 1000
    assert refused.value.retry_after == pytest.approx(4 * 3600, abs=60)
    assert "quota tokens_per_day=1000: their jobs trained 1200 tokens over the last 24 hours; try again in 4.0 h" \
        in str(refused.value)
    assert isinstance(refused.value, SubmissionError) and [r.name for r in table.all()] == ["first"]

    book.update("alice", quotas={"tokens_per_day": None, "queued": 1})   # one queued: a second waits for a start
    with pytest.raises(QuotaExceeded) as queued:
        core.submit(JobSubmission(job=job_dict("second", data, 5), user="alice"))
    assert queued.value.retry_after == 30 and "quota queued=1: 1 of their jobs are queued" in str(queued.value)
    table.close()


def test_a_quota_of_0_says_so_and_to_ask_an_admin_not_when_to_try_again(tmp_path):
    """A quota of 0 (daily tokens, queued jobs) admits nothing however long one waits: the refusal names the quota
    and its 0, says to ask an admin, and gives no wait (retry_after None: the HTTP API sends no Retry-After), even
    beside another quota's timed refusal; nothing is entered. A quota of 1 refuses with a wait, as before."""
    core, table, book, data, state = alice_with_quotas(tmp_path, {"tokens_per_day": 0})
    with pytest.raises(QuotaExceeded) as refused:
        core.submit(JobSubmission(job=job_dict("first", data, 5), user="alice"))
    assert refused.value.retry_after is None
    assert str(refused.value) == ("user alice: quota tokens_per_day=0: no job of theirs is admitted, now or later "
                                  "(waiting frees nothing); ask an admin of the service to raise it (`aspen user set "
                                  "alice --quota tokens_per_day=N`)")
    book.update("alice", quotas={"tokens_per_day": None, "queued": 0})
    with pytest.raises(QuotaExceeded) as queued:
        core.submit(JobSubmission(job=job_dict("first", data, 5), user="alice"))
    assert queued.value.retry_after is None and "quota queued=0: no job of theirs is admitted" in str(queued.value)
    book.update("alice", quotas={"queued": 1})   # room for one: a second is refused with a wait
    core.submit(JobSubmission(job=job_dict("first", data, 5), user="alice"))
    book.update("alice", quotas={"queued": 1, "tokens_per_day": 0})
    with pytest.raises(QuotaExceeded) as both:
        core.submit(JobSubmission(job=job_dict("second", data, 5), user="alice"))
    assert both.value.retry_after is None
    assert "quota queued=1" in str(both.value) and "tokens_per_day=0" in str(both.value)
    assert [r.name for r in table.all()] == ["first"]
    table.close()
