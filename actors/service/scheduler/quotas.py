"""Each user's quotas at submit (and when a job is queued again: resume, extend): their queued jobs and the tokens
their jobs trained over the last 24 hours, against users.json as it is now (`UserBook` reads it again whenever it
changed). A refusal says what frees it and when to try again (submissions.py raises it as `QuotaExceeded`: the
HTTP API's 429 with Retry-After), except a quota of 0, which no wait frees: it says so and to ask an admin to raise
it (a 429 without Retry-After); the running quota is the scheduler's, at each decision round (policies/base.py:
Admission)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from actors.service.accounts.users import UserBook, UserError
from actors.service.scheduler.user_standing import DAY_S
from actors.service.table.usage_accounts import UsageAccounts
from actors.spec.job_submission import JobSubmission

QUEUED_RETRY_S = 30   # the hint for a full queued quota: nothing says when one of the user's queued jobs starts


def _zero(name: str, quota: str) -> tuple[str, None]:
    return (f"user {name}: quota {quota}=0: no job of theirs is admitted, now or later (waiting frees nothing); ask "
            f"an admin of the service to raise it (`aspen user set {name} --quota {quota}=N`)", None)


def quota_problems(users: UserBook, usage: UsageAccounts,
                   submissions: Sequence[JobSubmission]) -> list[tuple[str, float | None]]:
    """Each user whose batch would pass their quota of queued jobs, or whose daily tokens are spent: what and
    why, with the seconds after which to try again (the daily tokens: until enough of them are 24 hours old;
    the queued jobs: QUEUED_RETRY_S, a hint); None for a quota of 0, which no wait frees."""
    problems = []
    for name in sorted({s.user for s in submissions if s.user is not None}):
        try:
            user = users.get(name)
        except UserError:
            continue   # refused per job (Submissions._user)
        new = sum(s.user == name for s in submissions)
        if user.max_queued == 0:
            problems.append(_zero(name, "queued"))
        elif user.max_queued is not None:
            queued = usage.unfinished_of(name).get("queued", 0)
            if queued + new > user.max_queued:
                problems.append((f"user {name}: quota queued={user.max_queued}: {queued} of their jobs are queued and "
                                 f"this adds {new}; wait for some to start or end (or cancel some), or ask the "
                                 "operator", QUEUED_RETRY_S))
        if user.tokens_per_day == 0:
            problems.append(_zero(name, "tokens_per_day"))
        elif user.tokens_per_day is not None:
            now = time.time()
            trained = usage.tokens_by_user(now - DAY_S).get(name, 0)
            if trained >= user.tokens_per_day:
                freed = usage.tokens_fall_below(name, now - DAY_S, user.tokens_per_day)
                wait = max(1.0, freed + DAY_S - now) if freed is not None else float(DAY_S)
                problems.append((f"user {name}: quota tokens_per_day={user.tokens_per_day}: their jobs trained "
                                 f"{trained} tokens over the last 24 hours; try again in {wait / 3600:.1f} h, when "
                                 "enough of them are 24 hours old, or ask the operator", wait))
    return problems
