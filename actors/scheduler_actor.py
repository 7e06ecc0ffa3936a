"""`SchedulerActor`: the named, long-lived service. It holds the job table (SQLite in its state folder),
starts and watches the trainers, starts a `JobActor` per running job, and assigns queued jobs to trainers
with its policy. A loop thread polls the trainers (their events carry progress and job endings) and
replaces a trainer that died; the jobs it held resume elsewhere from their checkpoints."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.core.config import NAMESPACE, ServiceConfig, TrainerConfig
from actors.core.events import TrainerStatus
from actors.core.job_table import TERMINAL_STATES, JobRecord, JobTable
from actors.core.listeners import Listeners
from actors.core.scheduler_core import SchedulerCore, StopRequest
from actors.engine.spec import JobSubmission
from actors.job_actor import JobActor
from actors.niceness import background_priority
from actors.trainer_actor import GpuTrainerActor
from orchestrator.observability import service_listeners
from policies.base import Preempt, Start
from policies.registry import load_policy

log = logging.getLogger(__name__)


@dataclass
class TrainerSlot:
    trainer_id: str
    config: TrainerConfig
    threads: int | None
    handle: Any = None
    ready_ref: Any = None
    poll_ref: Any = None
    poll_sent: float = 0.0
    status: TrainerStatus | None = None
    error: str | None = None
    restarts: int = 0
    actor_name: str = ""


@dataclass
class StartingJob:
    trainer_id: str
    actor: Any
    prepare_ref: Any
    group: int                     # jobs started by one decision round join their trainer together
    since: float = field(default_factory=time.time)


# A slow job's data does not hold the rest of its group back longer than this. Generous: on a 2-core machine
# four job actors starting at once (each importing torch and transformers, then tokenizing) take 35-45 s,
# and a group that starts piecemeal runs its first and last steps with part of its jobs (smaller, less
# efficient steps; bench/overhead.py).
GROUP_WAIT_S = 120.0


def default_trainers(config: ServiceConfig) -> list[TrainerConfig]:
    if config.trainers:
        return list(config.trainers)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        return [TrainerConfig(count=gpus, num_gpus=1)]
    return [TrainerConfig()]


@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)
class SchedulerActor:
    def __init__(self, config_json: str):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        background_priority()   # light work next to the trainers' torch threads (actors/niceness.py)
        self.config = ServiceConfig.model_validate_json(config_json)
        self.state_dir = Path(self.config.state_dir).expanduser().resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.listeners = Listeners(service_listeners(self.config))
        self.table = JobTable(self.state_dir / "jobs.sqlite", on_change=self.listeners.job_changed)
        self.core = SchedulerCore(self.table, load_policy(self.config.policy), self.state_dir,
                                  on_decision=self.listeners.decided)
        self.lock = threading.RLock()
        recovered = self.core.recover()
        if recovered:
            log.info("scheduler: %d unfinished jobs will resume from their checkpoints", len(recovered))
        self.slots: dict[str, TrainerSlot] = {}
        cpu_trainers = sum(t.count for t in default_trainers(self.config) if t.num_gpus == 0)
        index = 0
        for trainer in default_trainers(self.config):
            threads = trainer.threads or (max(1, (os.cpu_count() or 1) // max(cpu_trainers, 1))
                                          if trainer.num_gpus == 0 else None)
            for _ in range(trainer.count):
                slot = TrainerSlot(f"trainer-{index}", trainer, threads)
                self._launch(slot)
                self.slots[slot.trainer_id] = slot
                index += 1
        self.job_actors: dict[str, Any] = {}
        self.starting: dict[str, StartingJob] = {}
        self.rounds = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)
        self.thread.start()

    # -- client calls ---------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self.lock:
            return {"state_dir": str(self.state_dir), "policy": self.core.policy.name,
                    "trainers": [self._slot_info(s) for s in self.slots.values()], **self.listeners.describe()}

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Block until every trainer has loaded its model (or failed to)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if all(s.status is not None or s.error for s in self.slots.values()):
                    return self.info()
            time.sleep(0.1)
        raise TimeoutError(f"trainers not ready after {timeout:.0f}s: {self.info()['trainers']}")

    def submit(self, submission_json: str) -> JobRecord:
        return self.submit_many([submission_json])[0]

    def submit_many(self, submissions_json: list[str]) -> list[JobRecord]:
        """Jobs submitted together start together (one decision round; see `SchedulerCore.submit_many`)."""
        submissions = [JobSubmission.model_validate_json(text) for text in submissions_json]
        with self.lock:
            return self.core.submit_many(submissions)

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobRecord]:
        with self.lock:
            return self.table.all(states)

    def status(self, key: str) -> JobRecord:
        with self.lock:
            return self.table.find(key)

    def progress(self, key: str) -> list[dict[str, Any]]:
        with self.lock:
            return self.table.progress(self.table.find(key).id)

    def transitions(self, key: str) -> list[tuple[float, str, str]]:
        with self.lock:
            return self.table.transitions(self.table.find(key).id)

    def cancel(self, key: str, reason: str = "cancelled by the user") -> JobRecord:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.starting:       # not on its trainer yet
                del self.starting[record.id]
                return self.table.set_state(record.id, "cancelled", reason, trainer=None)
            record, stop = self.core.cancel(key, reason)
            self._send_stop(stop)
            return record

    def pause(self, key: str) -> JobRecord:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.starting:
                del self.starting[record.id]
                return self.table.set_state(record.id, "paused", "paused by the user", trainer=None)
            record, stop = self.core.pause(key)
            self._send_stop(stop)
            return record

    def resume(self, key: str) -> JobRecord:
        with self.lock:
            return self.core.resume(key)

    def trainers(self) -> list[dict[str, Any]]:
        with self.lock:
            return [self._slot_info(s) for s in self.slots.values()]

    def shutdown(self) -> None:
        """Stop the loop and the trainers (their running jobs are paused with a checkpoint and queued
        again for the next start of the service)."""
        self.stopping.set()
        self.thread.join(timeout=30)
        with self.lock:
            refs = {sid: s.handle.shutdown.remote() for sid, s in self.slots.items() if s.status is not None}
            for sid, ref in refs.items():
                try:
                    for event in ray.get(ref, timeout=180):
                        if event.kind == "paused":
                            self.core.preempting[event.job_id] = "the service stopped; resumes from its checkpoint"
                        self.core.apply_event(sid, event)
                except RayError as error:
                    log.warning("scheduler: trainer %s did not shut down cleanly: %s", sid, error)
            for slot in self.slots.values():
                if slot.handle is not None:
                    ray.kill(slot.handle)
            for actor in self.job_actors.values():
                ray.kill(actor)
            self.job_actors.clear()
            self.listeners.close()
            self.table.close()

    # -- the loop -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                with self.lock:
                    self._tick()
            except Exception:  # noqa: BLE001 - keep the service alive; the error is logged
                log.exception("scheduler: error in the scheduling loop")
            self.stopping.wait(self.config.tick_seconds)

    def _tick(self) -> None:
        for slot in self.slots.values():
            self._watch(slot)
        self._finish_starts()
        ready = [s.status for s in self.slots.values() if s.status is not None]
        if ready:
            self.rounds += 1
            for action in self.core.plan(ready):
                if isinstance(action, Start):
                    self._begin_start(action)
                elif isinstance(action, Preempt):
                    record = self.table.get(action.job)
                    self._send_stop(StopRequest(action.job, record.trainer or "", "paused", action.reason))
            self.listeners.tick(self.table.all(), ready)
        self._release_job_actors()
        self._explain_waits()

    def _launch(self, slot: TrainerSlot) -> None:
        service = ray.get_runtime_context().get_actor_name() or "aspen"
        slot.actor_name = f"{service}.{slot.trainer_id}.{slot.restarts}"
        options: dict[str, Any] = {"num_cpus": slot.config.num_cpus, "num_gpus": slot.config.num_gpus,
                                   "name": slot.actor_name, "namespace": NAMESPACE}
        slot.handle = GpuTrainerActor.options(**options).remote(slot.trainer_id, slot.config.model_dump_json(),
                                                               str(self.state_dir), slot.threads, self.config.policy)
        slot.ready_ref = slot.handle.start.remote()
        slot.poll_ref, slot.status, slot.error = None, None, None

    def _watch(self, slot: TrainerSlot) -> None:
        if slot.error:
            return
        if slot.status is None:
            if not ray.wait([slot.ready_ref], timeout=0)[0]:
                return
            try:
                slot.status = ray.get(slot.ready_ref)
                log.info("scheduler: %s ready (%s)", slot.trainer_id, slot.status.base_model)
            except RayError as error:
                slot.error = f"could not start: {getattr(error, 'cause', error)}"
                log.error("scheduler: trainer %s %s", slot.trainer_id, slot.error)
            return
        if slot.poll_ref is None:
            slot.poll_ref, slot.poll_sent = slot.handle.poll.remote(), time.time()
            return
        if not ray.wait([slot.poll_ref], timeout=0)[0]:
            if time.time() - slot.poll_sent > self.config.trainer_timeout_s:
                self._replace(slot, f"no answer for {self.config.trainer_timeout_s:.0f}s")
            return
        try:
            status, events = ray.get(slot.poll_ref)
        except (RayActorError, GetTimeoutError, RayError) as error:
            self._replace(slot, type(error).__name__)
            return
        slot.poll_ref = None
        slot.status = status
        # each event to the job table and then to the listeners, one at a time, so that listeners see a
        # job's progress and its state changes in the order they happened (progress before "completed")
        for event in events:
            self.core.apply_event(slot.trainer_id, event)
            self.listeners.trainer_polled(status, [event])
        if not events:
            self.listeners.trainer_polled(status, [])

    def _replace(self, slot: TrainerSlot, why: str) -> None:
        log.warning("scheduler: trainer %s lost (%s); starting a new one", slot.trainer_id, why)
        lost = self.core.trainer_lost(slot.trainer_id, why)
        for job_id in lost:
            self.starting.pop(job_id, None)
        try:
            ray.kill(slot.handle)
        except RayError:
            pass
        slot.restarts += 1
        self._launch(slot)

    def _begin_start(self, start: Start) -> None:
        job_id = start.job
        actor = self.job_actors.get(job_id)
        if actor is None:
            submission = self.table.submission(job_id)
            actor = JobActor.options(name=f"aspen-job-{job_id}-{int(time.time() * 1000)}").remote(
                job_id, submission.model_dump_json(), str(self.state_dir / "cache"))
            self.job_actors[job_id] = actor
        self.starting[job_id] = StartingJob(start.trainer, actor, actor.prepare.remote(), self.rounds)

    def _finish_starts(self) -> None:
        """Hand prepared jobs to their trainers: a decision round's jobs together (so that jobs submitted
        together train together from their first step), unless one of them takes too long."""
        ready = {job_id for job_id, s in self.starting.items() if ray.wait([s.prepare_ref], timeout=0)[0]}
        groups: dict[int, list[str]] = {}
        for job_id, starting in self.starting.items():
            groups.setdefault(starting.group, []).append(job_id)
        now = time.time()
        batches: dict[str, list[tuple]] = {}
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
            self.slots[trainer_id].handle.assign.remote(assignments)

    def _prepared(self, job_id: str, starting: StartingJob) -> tuple | None:
        record = self.table.get(job_id)
        if record.state != "running" or record.trainer != starting.trainer_id:
            return None  # cancelled, paused or requeued meanwhile
        try:
            summary, eval_examples = ray.get(starting.prepare_ref)
        except RayError as error:
            cause = getattr(error, "cause", None) or error
            self.core.start_failed(job_id, f"its data could not be read: {cause}")
            return None
        self.table.update(job_id, total_steps=summary.total_steps)
        submission = self.table.submission(job_id)
        return (job_id, submission.model_dump_json(), record.output_dir, summary, eval_examples, starting.actor)

    def _release_job_actors(self) -> None:
        for job_id in list(self.job_actors):
            if self.table.get(job_id).state in TERMINAL_STATES | {"paused"} and job_id not in self.starting:
                ray.kill(self.job_actors.pop(job_id))

    def _explain_waits(self) -> None:
        broken = [s for s in self.slots.values() if s.error]
        if not broken or any(s.status is not None for s in self.slots.values()):
            return
        for record in self.table.all(("queued",)):
            self.table.set_reason(record.id, "; ".join(f"trainer {s.trainer_id} {s.error}" for s in broken))

    def _send_stop(self, stop: StopRequest | None) -> None:
        if stop is None:
            return
        slot = self.slots.get(stop.trainer)
        if slot is None or slot.handle is None:
            raise ValueError(f"job {stop.job} is on trainer {stop.trainer}, which this service does not have")
        slot.handle.stop_job.remote(stop.job, stop.kind, stop.reason)

    def _slot_info(self, slot: TrainerSlot) -> dict[str, Any]:
        info: dict[str, Any] = {"id": slot.trainer_id, "base_model": slot.config.base_model,
                                "quantization": slot.config.quantization, "error": slot.error,
                                "restarts": slot.restarts, "ready": slot.status is not None,
                                "actor_name": slot.actor_name}
        if slot.status is not None:
            status = asdict(slot.status)
            status.pop("linear_shapes")
            info.update(status)
            view = self.core.trainer_view(slot.status)
            info.update(memory_fixed_bytes=view.base_bytes, memory_step_bytes=view.step_memory_bytes)
        return info
