"""The scheduling policy, contained (it may be third-party code): a job it fails on is parked, and a policy
that fails on everything is replaced by FIFO.

A policy that raises (or answers with something that is not a list of decisions, or a decision whose job, trainer or
reason is not a str) on one queued job has that job parked with the reason while the others are scheduled; a policy
that fails on everything, or on job after job, is replaced by FIFO for the rest of the service's life (logged, and
reported by the service's info), and the jobs parked for it are queued again.

A policy's call has a time limit (`policy_timeout_s`, policy_clock.py): a round whose policy overruns it is decided
by FIFO instead, logged and said in the service's info (`policy_warnings`); one that overruns
POLICY_OVERRUNS_BEFORE_FIFO rounds in a row (a call still running counts) is replaced by FIFO as a failing one is.
FIFO, not the policy's decisions of an earlier round: those were made on an earlier snapshot (their jobs started,
ended or preempted since) and would be carried out again; FIFO decides on this round's snapshot, with the
placement every policy's Starts are checked against, and is what the policy is replaced by if it goes on
overrunning. What else a policy asks that is not done (a job that does not exist, a preemption of a job that does
not run) is said once per policy and job (`warn`), in the log and in the same `policy_warnings`: the latest
POLICY_WARNINGS_KEPT are shown; what was said is remembered apart (the latest POLICY_SAID_ONCE_KEPT keys), where a
policy asking the impossible of more jobs than the info shows had each said again every round.

The policy is called on the round's snapshot with the service's lock released while the round waits for it
(`decide`'s `outside`, SchedulerCore.plan); what the guard itself writes (a job parked for the policy's exceptions,
jobs given back when FIFO replaces it) is written once the lock is held again, each job checked then."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import fields, replace

from actors.service.scheduler.policy_clock import POLICY_TIMEOUT_S, Outside, PolicyClock, PolicyOverran
from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.table.job_table import ACTIVE_STATES, JobRecord, JobTable
from policies.base import WAIT_CAUSES, Decision, JobView, Move, Policy, Preempt, Snapshot, Start, Wait
from policies.fifo import FifoPolicy

log = logging.getLogger(__name__)

POLICY_FAILURES_BEFORE_FIFO = 3   # jobs parked for a policy's exceptions before the policy itself is replaced
POLICY_OVERRUNS_BEFORE_FIFO = 3   # rounds in a row past the policy's time limit before it is replaced
POLICY_WARNINGS_KEPT = 50         # the latest warnings the service's info shows
POLICY_SAID_ONCE_KEPT = 10_000    # the latest warnings' keys remembered as said (a long service with many jobs)


def park(table: JobTable, record: JobRecord, why: str) -> None:
    """Take a job out of scheduling with the reason (paused: `aspen resume` once the cause is fixed)."""
    log.error("scheduler: job %s parked: %s", record.id, why)
    if record.state == "running":
        return   # it keeps training; it is only left out of this round's decisions
    table.set_state(record.id, "paused", f"{why}; the other jobs go on (resume it once the cause is fixed)",
                    trainer=None)


def bounded_cause(decision: Decision) -> Decision:
    """A Wait whose cause is not one of WAIT_CAUSES (a plug-in's own text) as cause "other", the text kept in the
    reason: each cause is a metrics label, and a plug-in's free-form causes (a job id, a number in them) grew the
    label set without bound."""
    if not isinstance(decision, Wait) or decision.cause in WAIT_CAUSES:
        return decision
    return replace(decision, cause="other", reason=f"{decision.reason} (the policy's cause: {decision.cause:.200})")


class PolicyGuard:
    def __init__(self, policy: Policy, table: JobTable, scheduling: SchedulingStates,
                 timeout_s: float = POLICY_TIMEOUT_S):
        self.policy = policy
        self.error: str | None = None     # why the configured policy was replaced by FIFO
        self.table = table
        self.scheduling = scheduling
        self.clock = PolicyClock(timeout_s)
        self.overruns = 0                 # rounds in a row the policy overran its time limit
        self.rounds_without = 0           # rounds decided by FIFO because the policy overran
        self.deadline = 0.0               # the monotonic time by which this round's calls must answer
        self.warnings: dict[str, str] = {}   # what the policy asked that was not done, the latest shown
        self.said: dict[str, None] = {}      # the keys of what was said (once per kind and job), the latest kept
        self.outside: Outside = contextlib.nullcontext   # what this round waits for the policy inside (decide)

    def describe(self) -> dict[str, object]:
        """The policy's part of the service's info: `policy_error` where FIFO replaced it, `policy_warnings`,
        `policy_calls_left` (calls left running past their round) and `policy_call_running` while one runs."""
        running = self.clock.running_said()
        return {**({"policy_error": self.error} if self.error else {}),
                **({"policy_warnings": list(self.warnings.values())} if self.warnings else {}),
                **({"policy_calls_left": self.clock.left} if self.clock.left else {}),
                **({"policy_call_running": running} if running else {})}

    def warn(self, key: str, message: str) -> None:
        """Log `message` and keep it for the service's info, once per `key` (a policy asking the same every round
        does not flood the log); the latest POLICY_WARNINGS_KEPT are shown, the latest POLICY_SAID_ONCE_KEPT keys
        remembered as said."""
        if key in self.said:
            return
        log.warning("scheduler: %s", message)
        self.said[key] = None
        while len(self.said) > POLICY_SAID_ONCE_KEPT:
            del self.said[next(iter(self.said))]
        self.warnings[key] = message
        while len(self.warnings) > POLICY_WARNINGS_KEPT:
            del self.warnings[next(iter(self.warnings))]

    def unknown_job(self, decision: Decision) -> None:
        """A decision on a job id the round's snapshot does not hold: not done, said (once per policy and job)."""
        self.warn(f"{self.policy.name} unknown {decision.job}", f"policy '{self.policy.name}' decided "
                  f"{decision!r:.200}, but the scheduler has no active job {decision.job!r}: not done")

    def not_running(self, job: JobView, decision: Decision) -> None:
        """A preemption of a job that does not run: not done, said (once per policy and job)."""
        self.warn(f"{self.policy.name} preempt {job.id}", f"policy '{self.policy.name}' preempted job {job.id} "
                  f"({decision.reason!r:.100}), which is {job.state}, not running: not done (only a running job can "
                  "be preempted)")

    def cannot_start(self, job: JobView, decision: Start) -> None:
        """A Start of a job that is not queued (running, or preempting): not done, said (once per policy and job)."""
        self.warn(f"{self.policy.name} start {job.id}", f"policy '{self.policy.name}' started job {job.id} on "
                  f"{decision.trainer}, which is {job.state}{f' on {job.trainer}' if job.trainer else ''}, not "
                  "queued: not done (only a queued job can be started)")

    def cannot_move(self, job: JobView, decision: Move, why: str) -> None:
        """A Move that cannot be carried out (`why`: policy_answer.move_refusal): not done, said (once per policy
        and job)."""
        self.warn(f"{self.policy.name} move {job.id}", f"policy '{self.policy.name}' moved job {job.id} "
                  f"({job.state} on {job.trainer}) to {decision.trainer}, but {why}: not done")

    def stays_interactive(self, job: JobView, decision: Decision) -> None:
        """A Preempt or Move of an interactive model, which stays on its trainer: not done, said (once per policy
        and job)."""
        kind = type(decision).__name__.lower()
        self.warn(f"{self.policy.name} {kind} {job.id}", f"policy '{self.policy.name}' decided {kind} of job "
                  f"{job.id}, an interactive model, which stays on its trainer (its user's session runs there): "
                  "not done")

    def decide(self, snapshot: Snapshot, outside: Outside = contextlib.nullcontext) -> list[Decision]:
        """The policy's decisions, within its time limit (`_overran` where it is not kept); each wait for the policy
        inside `outside()` (the service's lock released: the scheduler loop's `unlocked`)."""
        self.deadline = self.clock.deadline()
        self.outside = outside
        try:
            decisions = self._contained(snapshot)
        except PolicyOverran as overran:
            return self._overran(snapshot, overran)
        self.overruns = 0
        return decisions

    def _overran(self, snapshot: Snapshot, overran: PolicyOverran) -> list[Decision]:
        """This round decided by FIFO (the module's docstring says why), said; the policy replaced by FIFO where it
        overran POLICY_OVERRUNS_BEFORE_FIFO rounds in a row."""
        self.overruns += 1
        if self.overruns >= POLICY_OVERRUNS_BEFORE_FIFO:
            return self._fall_back(snapshot, overran)
        self.rounds_without += 1
        message = (f"policy '{self.policy.name}' overran its time limit: {overran}; this round was decided by FIFO "
                   f"({self.rounds_without} so far); after {POLICY_OVERRUNS_BEFORE_FIFO} rounds in a row FIFO "
                   "replaces it (raise policy_timeout_s in the service's config if it needs longer)")
        self.warnings.pop("overran", None)   # said again each round, with its count
        self.said.pop("overran", None)
        self.warn("overran", message)
        return FifoPolicy().decide(snapshot)

    def _contained(self, snapshot: Snapshot) -> list[Decision]:
        """The policy's decisions. If it fails, find the queued jobs it fails on by asking about each alone,
        park those with the reason and decide for the rest; if it fails even with no queued job, or on
        every one, replace it with FIFO for the rest of this service's life (logged)."""
        try:
            return self._ask(snapshot)
        except Exception as error:  # noqa: BLE001 - plug-in code: contained below
            first = error
        queued = [j for j in snapshot.jobs if j.state == "queued"]
        others = tuple(j for j in snapshot.jobs if j.state != "queued")
        try:
            self._ask(replace(snapshot, jobs=others))
        except Exception as error:  # noqa: BLE001 - plug-in code failing with no queued job: FIFO takes over
            return self._fall_back(snapshot, error)
        culprits: dict[str, Exception] = {}
        for job in queued:
            try:
                self._ask(replace(snapshot, jobs=(*others, job)))
            except Exception as error:  # noqa: BLE001 - plug-in code: this job is parked, the others go on
                culprits[job.id] = error
        if (not culprits or len(culprits) == len(queued) > 1
                or len(self.scheduling.parked_by_policy()) + len(culprits) >= POLICY_FAILURES_BEFORE_FIFO):
            return self._fall_back(snapshot, first)
        still = {r.id: r for r in self.table.all(("queued",))}   # not cancelled or deleted while it decided
        for job in queued:
            if job.id in culprits and job.id in still:
                park(self.table, still[job.id], f"the scheduling policy '{self.policy.name}' fails on this job: "
                                                f"{culprits[job.id]!r}")
                self.scheduling.of(job.id).parked_by_policy = True
        rest = replace(snapshot, jobs=tuple(j for j in snapshot.jobs if j.id not in culprits))
        try:
            return self._ask(rest)
        except Exception as error:  # noqa: BLE001 - fails only in combination: give up on the policy
            return self._fall_back(rest, error)

    def _ask(self, snapshot: Snapshot) -> list[Decision]:
        """The policy's answer, checked; within the round's time limit (FIFO, which replaced it, is ours: not timed)."""
        if self.error is None:
            decisions = self.clock.call(self.policy.decide, snapshot, self.deadline,
                                        getattr(self.policy, "name", type(self.policy).__name__), self.outside)
        else:
            decisions = self.policy.decide(snapshot)
        if not isinstance(decisions, list) or not all(isinstance(d, (Start, Preempt, Move, Wait)) for d in decisions):
            raise TypeError(f"policy {getattr(self.policy, 'name', '?')!r} returned {decisions!r:.200}, not a "
                            "list of Start / Preempt / Move / Wait")
        for decision in decisions:   # a job id that is a list stopped every later round of the scheduler
            wrong = [f.name for f in fields(decision) if not isinstance(getattr(decision, f.name), str)]
            if wrong:
                raise TypeError(f"policy {getattr(self.policy, 'name', '?')!r} returned {decision!r:.200}: its "
                                f"{' and '.join(wrong)} must be a str (a job id, a trainer id, a reason)")
        if any(j.state == "queued" for j in snapshot.jobs):
            self.scheduling.clear_parked()   # it works with queued jobs: earlier parked jobs were its exceptions
        return [bounded_cause(d) for d in decisions]

    def _fall_back(self, snapshot: Snapshot, error: Exception) -> list[Decision]:
        """Replace the policy by FIFO (logged, and reported by the service's info) and give back the jobs
        parked because of it: they were not at fault."""
        name = getattr(self.policy, "name", type(self.policy).__name__)
        what = (f"overran its time limit {self.overruns} rounds in a row (the last: {error})"
                if isinstance(error, PolicyOverran) else f"failed ({error!r})")
        self.error = f"policy '{name}' {what}; the service schedules FIFO until it restarts with a working policy"
        log.error("scheduler: %s", self.error, exc_info=error)
        self.policy = FifoPolicy()
        for job_id in self.scheduling.parked_by_policy():
            if self.table.get(job_id).state == "paused":
                self.table.set_state(job_id, "queued", f"policy '{name}' was replaced by FIFO", trainer=None)
        self.scheduling.clear_parked()
        return self._ask(replace(snapshot, jobs=tuple(self._refresh(snapshot.jobs))))

    def _refresh(self, jobs: tuple[JobView, ...]) -> list[JobView]:
        """The views with the states now in the table (jobs given back by `_fall_back` are queued again)."""
        states = {r.id: r.state for r in self.table.all(ACTIVE_STATES)}
        return [replace(j, state=states[j.id]) for j in jobs if j.id in states]
