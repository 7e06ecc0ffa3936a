"""Starting jobs on their trainers, for the scheduler actor: a job actor per started job (created when the
policy starts the job, never reused once it was lost or hung), the job's data prepared by it, the job
handed to its trainer together with the rest of its decision round (so that jobs submitted together train
together from their first step), and the job actor let go once the job ends or pauses. A job actor runs on
its trainer's node (it feeds that trainer; a lost node takes both, and both start again on a live one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.job_actor import JobActor
from actors.ray_links import ActorJobLink
from actors.service.scheduler.config import StorageConfig
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import TERMINAL_STATES, JobTable
from actors.service.trainer.job_link import Assignment
from actors.storage.storage_errors import StorageUnreachable
from actors.storage.storage_uri import as_location
from policies.base import Start

log = logging.getLogger(__name__)

# A slow job's data does not hold the rest of its group back longer than this. Generous: on a 2-core machine
# four job actors starting at once (each importing torch and transformers, then tokenizing) take 35-45 s,
# and a group that starts piecemeal runs its first and last steps with part of its jobs (smaller, less
# efficient steps; bench/overhead.py).
GROUP_WAIT_S = 120.0


@dataclass
class StartingJob:
    trainer_id: str
    actor: Any
    prepare_ref: Any
    group: int                     # jobs started by one decision round join their trainer together
    since: float = field(default_factory=time.time)


class JobStarts:
    """The job actors of a scheduler and the jobs on their way to a trainer (called under its lock)."""

    def __init__(self, table: JobTable, core: SchedulerCore, state_dir: Path,
                 node_of: Callable[[str], str | None] = lambda trainer_id: None, storage: StorageConfig | None = None):
        """`node_of`: the node a trainer runs on (None: unknown; the job actor goes where Ray puts it).
        `storage`: the service's `storage:` settings, handed to every job actor."""
        self.storage = storage
        self.node_of = node_of
        self.table = table
        self.core = core
        self.state_dir = state_dir
        self.actors: dict[str, Any] = {}             # job id -> its job actor
        self.starting: dict[str, StartingJob] = {}   # job id -> on its way to its trainer

    def __contains__(self, job_id: str) -> bool:
        """Whether the job is on its way to its trainer (started, not assigned yet)."""
        return job_id in self.starting

    def drop(self, job_id: str) -> None:
        """Forget a job on its way (cancelled, paused or its trainer lost before it arrived)."""
        self.starting.pop(job_id, None)

    def kill_all(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()

    def begin(self, start: Start, round_number: int) -> None:
        """Create (or reuse) the job's actor and have it prepare the job's data."""
        job_id = start.job
        actor = self.actors.get(job_id)
        if actor is not None and self.core.scheduling.needs_new_job_actor(job_id):   # lost or hung: never reused
            ray.kill(self.actors.pop(job_id))
            actor = None
        self.core.scheduling.job_actor_replaced(job_id)
        if actor is None:
            submission = self.table.submission(job_id)
            options: dict[str, Any] = {"name": f"aspen-job-{job_id}-{int(time.time() * 1000)}"}
            node = self.node_of(start.trainer)
            if node is not None:
                # not soft: Ray's soft affinity sends a 0-CPU actor elsewhere when the node's CPUs are all held (by
                # its trainer); a node that is gone fails the start, and the job starts again with a new actor
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = JobActor.options(**options).remote(job_id, submission, str(self.state_dir / "cache"),
                                                       storage=self.storage)
            log.info("job %s: a new job actor, next to %s (node %s)", job_id, start.trainer, (node or "any")[:8])
            self.actors[job_id] = actor
        self.starting[job_id] = StartingJob(start.trainer, actor, actor.prepare.remote(), round_number)

    def finish(self, assign: Callable[[str, list[Assignment]], Any]) -> None:
        """Hand prepared jobs to their trainers: a decision round's jobs together (so that jobs submitted
        together train together from their first step), unless one of them takes too long."""
        ready = {job_id for job_id, s in self.starting.items() if ray.wait([s.prepare_ref], timeout=0)[0]}
        groups: dict[int, list[str]] = {}
        for job_id, starting in self.starting.items():
            groups.setdefault(starting.group, []).append(job_id)
        now = time.time()
        batches: dict[str, list[Assignment]] = {}
        for members in groups.values():
            overdue = any(now - self.starting[j].since > GROUP_WAIT_S for j in members)
            if not overdue and not all(j in ready for j in members):
                continue
            for job_id in members:
                if job_id not in ready:
                    continue
                starting = self.starting.pop(job_id)
                assignment = self._prepared(job_id, starting)
                if assignment is not None:
                    batches.setdefault(starting.trainer_id, []).append(assignment)
        for trainer_id, assignments in batches.items():
            assign(trainer_id, assignments)

    def _prepared(self, job_id: str, starting: StartingJob) -> Assignment | None:
        record = self.table.get(job_id)
        if record.state != "running" or record.trainer != starting.trainer_id:
            return None  # cancelled, paused or requeued meanwhile
        try:
            summary, eval_examples = ray.get(starting.prepare_ref)
        except RayActorError as error:   # the job actor died: start the job again with a new one
            self.core.start_lost(job_id, f"its job actor was lost while reading its data ({type(error).__name__})")
            return None
        except RayError as error:
            cause = getattr(error, "cause", None) or error
            if isinstance(cause, StorageUnreachable):   # the storage did not answer: started again (bounded)
                self.core.start_lost(job_id, f"its data could not be read: {cause}")
            else:
                self.core.start_failed(job_id, f"its data could not be read: {cause}")
            return None
        self.table.update(job_id, total_steps=summary.total_steps)
        submission = self.table.submission(job_id)
        return Assignment(job_id=job_id, submission=submission, output_dir=as_location(record.output_dir),
                          data=summary, eval_examples=eval_examples, link=ActorJobLink(starting.actor))

    def release(self) -> None:
        """Let go of the job actors of jobs that ended, paused or must get a new one."""
        for job_id in list(self.actors):
            if job_id in self.starting:
                continue
            try:
                state = self.table.get(job_id).state
            except KeyError:    # deleted
                state = "cancelled"
            if state in TERMINAL_STATES | {"paused"} or self.core.scheduling.needs_new_job_actor(job_id):
                ray.kill(self.actors.pop(job_id))
                self.core.scheduling.job_actor_replaced(job_id)
