"""A moved job's second round (SchedulerCore.plan says how a `Move` is carried out): the jobs whose pause has
landed are started on their targets, where those still hold them, before the policy is asked; otherwise the pin is
dropped and the policy places the job like any queued job. Moved from scheduler_core.py (its size)."""

from __future__ import annotations

import logging

from actors.service.scheduler.job_fit import trainer_view
from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerStatus
from policies.base import Start, memory_in_use

log = logging.getLogger(__name__)


def start_moved(table: JobTable, scheduling: SchedulingStates, trainers: list[TrainerStatus]) -> list[Start]:
    """Start the moved jobs whose pause has landed on their target trainers, where those still hold them."""
    starts: list[Start] = []
    statuses = {t.trainer_id: t for t in trainers}
    moving = sorted(((job_id, state) for job_id, state in scheduling.items() if state.moving_to is not None),
                    key=lambda item: item[1].moved_at or 0.0)   # in the order they were moved
    for job_id, state in moving:
        target = state.moving_to
        try:
            record = table.get(job_id)
        except KeyError:
            table.after_commit(lambda state=state: setattr(state, "moving_to", None))
            continue
        if record.state != "queued":
            continue   # still pausing on its old trainer (or paused / ended by the user meanwhile)
        status = statuses.get(target)
        problem = "it is gone" if status is None else no_room(table, scheduling, job_id, status)
        if problem:
            log.warning("scheduler: moved job %s cannot resume on %s (%s); the policy places it", job_id, target,
                        problem)
            table.set_reason(job_id, f"{record.reason}; {target} no longer holds it ({problem})")
        else:
            table.set_state(job_id, "running", f"starting on {target} (moved)", trainer=target)
            starts.append(Start(job=job_id, trainer=target))
        table.after_commit(lambda state=state: setattr(state, "moving_to", None))
    return starts


def no_room(table: JobTable, scheduling: SchedulingStates, job_id: str, status: TrainerStatus) -> str | None:
    """Why the trainer cannot take the job now (memory budget, max_jobs), or None."""
    view = trainer_view(status)
    here = [r for r in table.all(("running",)) if r.trainer == status.trainer_id]
    if view.max_jobs is not None and len(here) >= view.max_jobs:
        return f"it runs {view.max_jobs} jobs (max_jobs)"
    held = memory_in_use(view, []) + sum(_memory(scheduling, r.id) for r in here)
    need = _memory(scheduling, job_id)
    if held + need > view.memory_budget_bytes:
        return f"{max(view.memory_budget_bytes - held, 0) / 2**20:.0f} MiB free, it needs {need / 2**20:.0f} MiB"
    return None


def _memory(scheduling: SchedulingStates, job_id: str) -> int:
    """The job's adapter memory as estimated so far (0 before its first estimate)."""
    state = scheduling.get(job_id)
    return (state.memory or 0) if state is not None else 0
