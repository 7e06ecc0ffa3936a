"""Each user's standing for the fair share (actors/service/scheduler/user_standing.py), against the users file
it is read from: shares and quotas as written, read again at once when the file changes (a quota holds from the
next decision round, with no clock moved), the trained tokens summed again only after STANDING_REFRESH_S, a
damaged file said in the log and scheduled as without users, no file no standing."""

from __future__ import annotations

import logging

from actors.service.accounts.users import UserBook
from actors.service.scheduler.user_standing import STANDING_REFRESH_S, UserStanding
from actors.service.table.job_table import JobTable


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_shares_and_quotas_as_written_read_again_when_the_file_changes(tmp_path, caplog):
    book = UserBook.in_state_dir(tmp_path)
    table = JobTable(tmp_path / "jobs.sqlite")
    clock = Clock()
    standing = UserStanding(book, table, window_s=3600, clock=clock)
    assert standing.current() == {}                       # no users file: every job by the policy alone

    book.add("alice", share=2, quotas={"running": 1, "tokens_per_day": 5000})
    users = standing.current()                             # the file appeared: read at once, the clock unmoved
    assert set(users) == {"alice"}
    assert (users["alice"].share, users["alice"].max_running, users["alice"].tokens_per_day) == (2.0, 1, 5000)
    assert users["alice"].trained_tokens == 0 and users["alice"].tokens_today == 0

    book.add("bob")
    assert set(standing.current()) == {"alice", "bob"} and standing.current()["bob"].share == 1.0
    book.update("alice", quotas={"running": 3})            # `aspen user set`: at the next round, not in 5 s
    assert standing.current()["alice"].max_running == 3

    kept = standing.current()                              # unchanged file, within the refresh: not read again
    assert standing.current() is kept
    clock.now += STANDING_REFRESH_S
    assert standing.current() is not kept and standing.current() == kept

    book.path.write_text("{ not json")                    # damaged: logged, scheduled as without users
    clock.now += STANDING_REFRESH_S
    with caplog.at_level(logging.ERROR, logger="actors.service.scheduler.user_standing"):
        assert standing.current() == {}
    assert str(book.path) in caplog.text
