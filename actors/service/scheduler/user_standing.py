"""Each user's standing for the policy's fair share and quotas: their share and limits (users.json) beside the
tokens their jobs trained over the fair-share window and today (the job table's usage). Read again whenever the
users file changed (its time, size or inode, looked at on each call: a quota set with `aspen user set` holds from
the next decision round), and the tokens at most every STANDING_REFRESH_S."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actors.service.accounts.users import UserBook, UsersFileError
from actors.service.table.job_table import JobTable
from policies.base import UserShare

log = logging.getLogger(__name__)

STANDING_REFRESH_S = 5.0   # how often the trained tokens are summed again (users.json: whenever it changed)
DAY_S = 86_400


class UserStanding:
    """`current()`: each user's `UserShare` (None: the operator's jobs), kept for STANDING_REFRESH_S while the users
    file stays as it was."""

    def __init__(self, book: UserBook, table: JobTable, window_s: float, clock: Callable[[], float] = time.time):
        self.book, self.table, self.window_s, self.clock = book, table, window_s, clock
        self.kept: tuple[float, object, dict[str | None, UserShare]] | None = None   # when read, the file's stamp, what

    def current(self) -> dict[str | None, UserShare]:
        """Each user's share, trained tokens over the fair-share window and quotas; none without a users file
        (every job is then ordered by the policy alone)."""
        now = self.clock()
        stamp = self.book.stamp()
        if self.kept is not None and now - self.kept[0] < STANDING_REFRESH_S and stamp == self.kept[1]:
            return self.kept[2]
        standing: dict[str | None, UserShare] = {}
        if self.book.exists():
            try:
                users = self.book.users()
            except UsersFileError as error:   # the operator is told; scheduling goes on as without users
                log.error("scheduler: %s", error)
                users = []
            window = self.table.usage.tokens_by_user(now - self.window_s)
            day = self.table.usage.tokens_by_user(now - DAY_S)
            for user in users:
                standing[user.name] = UserShare(share=user.share, trained_tokens=window.get(user.name, 0),
                                                max_running=user.max_running, tokens_per_day=user.tokens_per_day,
                                                tokens_today=day.get(user.name, 0))
            for name, tokens in window.items():   # an operator's jobs (None), a removed user's: share 1
                standing.setdefault(name, UserShare(trained_tokens=tokens))
        self.kept = (now, stamp, standing)
        return standing
