"""`SchedulerActor`: the named, long-lived service. It holds the job table (SQLite in its state folder),
starts and watches the trainers, starts a `JobActor` per running job, and assigns queued jobs to trainers
with its policy. A loop thread polls the trainers (their events carry progress and job endings) and
replaces a trainer that died; the jobs it held resume elsewhere from their checkpoints.

Nothing a trainer reports is lost: polled events wait in a queue per trainer until the job table has taken
them (one transaction per batch, retried with backoff while another process holds the table's file), and
the events still waiting when the service stops are written next to the table and applied at its next
start. The actor restarts itself when its process dies (`max_restarts=-1`): the new instance reloads the
table, and the jobs that were running resume from their checkpoints."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.service.config import NAMESPACE, ServiceConfig, TrainerConfig
from actors.service.trainer_reports import TrainerEvent, TrainerStatus
from actors.service.job_table import JobRecord, JobTableBusy
from actors.service.listeners import Listeners
from actors.service.state_dir import (forget_spilled_events, lock_state_dir, open_job_table,
                                      read_spilled_events, spill_events)
from actors.service.scheduler_core import ACTIVE_STATES, SchedulerCore, StopRequest, SubmissionError
from actors.engine.spec import JobSubmission
from actors.job_starts import JobStarts
from actors.niceness import background_priority
from actors.trainer_actor import TrainerActor
from policies.base import Move, Preempt, Start
from policies.registry import load_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerLost:
    """In a trainer's queue of table work: the trainer died after the events before this one."""

    why: str


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
    pending: deque = field(default_factory=deque)   # TrainerEvent | TrainerLost not yet in the job table


TABLE_RETRY_S = (0.5, 10.0)     # backoff between tries to write what the job table could not take
# A decision round (snapshot, policy, listeners) may take at most this share of the scheduler's time, so
# that a submission rarely waits behind one: with thousands of queued jobs rounds come less often than
# tick_seconds (a 40 ms round: every 2 s). Trainer events are still taken every tick.
ROUND_SHARE = 0.02
ROUND_PACED_FROM_S = 0.01   # rounds shorter than this (a table of tens of jobs) run every tick


def default_trainers(config: ServiceConfig) -> list[TrainerConfig]:
    if config.trainers:
        return list(config.trainers)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        return [TrainerConfig(count=gpus, num_gpus=1)]
    return [TrainerConfig()]


def build_listeners(factory: str | None, config: ServiceConfig) -> list:
    """The listeners `factory` ('module:function') builds for `config`; none without a factory."""
    if factory is None:
        return []
    module, _, function = factory.partition(":")
    if not module or not function:
        raise ValueError(f"listeners factory '{factory}' is not 'module:function'")
    return list(getattr(importlib.import_module(module), function)(config))


@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)
class SchedulerActor:
    def __init__(self, config_json: str, listeners: str | None = None):
        """`listeners`: 'module:function' that builds the service's listeners from its configuration (the
        client passes `orchestrator.observability:service_listeners`: metrics and MQTT events); None: none.
        Named, not imported here, so that this layer does not depend on the user-facing one above it."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        background_priority()   # light work next to the trainers' torch threads (actors/niceness.py)
        self.config = ServiceConfig.model_validate_json(config_json)
        self.state_dir = Path(self.config.state_dir).expanduser().resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_lock = lock_state_dir(self.state_dir)
        self.incarnation = f"{int(time.time() * 1000):x}"
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.listeners = Listeners(build_listeners(listeners, self.config))
        self.table = open_job_table(self.state_dir / "jobs.sqlite", self.listeners.job_changed)
        output_root = self.config.output_root
        self.core = SchedulerCore(self.table, load_policy(self.config.policy), self.state_dir,
                                  on_decision=self.listeners.decided, trainers=default_trainers(self.config),
                                  output_root=output_root)
        self.lock = threading.RLock()
        self.table_retry_at = 0.0          # while the table is locked: when to try again
        self.table_backoff = TABLE_RETRY_S[0]
        self._replay_unapplied_events()
        recovered = self.core.recover(resume=self.config.resume_on_start or restarted)
        if recovered:
            log.info("scheduler: %d unfinished jobs %s", len(recovered),
                     "will resume from their checkpoints" if self.config.resume_on_start or restarted
                     else "are held until resumed")
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
        self.job_starts = JobStarts(self.table, self.core, self.state_dir)
        self.rounds = 0
        self.next_round_at = 0.0           # monotonic time before which no decision round starts (ROUND_SHARE)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)
        self.thread.start()

    # -- client calls ---------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self.lock:
            info = {"state_dir": str(self.state_dir), "policy": self.core.policy.name,
                    "output_root": str(self.core.output_root) if self.core.output_root else None,
                    "trainers": [self._slot_info(s) for s in self.slots.values()], **self.listeners.describe()}
            if self.core.policy_error:
                info["policy_error"] = self.core.policy_error
            waiting = sum(len(s.pending) for s in self.slots.values())
            if waiting:
                info["table_error"] = f"{waiting} trainer events wait for the job table (it is locked); retrying"
            return info

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

    def submit_many(self, submissions_json: list[str], job_ids: list[str] | None = None) -> list[JobRecord]:
        """Jobs submitted together start together (one decision round; see `SchedulerCore.submit_many`).
        All or none: a bad one is named and nothing is entered."""
        submissions, problems = [], []
        for index, text in enumerate(submissions_json):
            try:
                submissions.append(JobSubmission.model_validate_json(text))
            except ValueError as error:
                problems.append(f"submission {index + 1} of {len(submissions_json)}: {error}")
        if problems:
            raise SubmissionError("nothing was submitted: " + "; ".join(problems))
        with self.lock:
            return self.core.submit_many(submissions, job_ids)

    def submission(self, key: str) -> str:
        """The job's submission as stored (JSON), e.g. to compare a jobs file against it."""
        with self.lock:
            return self.table.submission(self.table.find(key).id).model_dump_json()

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
            if record.id in self.job_starts:       # not on its trainer yet
                record = self.table.set_state(record.id, "cancelled", reason, trainer=None)
                self.job_starts.drop(record.id)
                return record
            record, stop = self.core.cancel(key, reason)
            self._send_stop(stop)
            return record

    def pause(self, key: str) -> JobRecord:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.job_starts:
                record = self.table.set_state(record.id, "paused", "paused by the user", trainer=None)
                self.job_starts.drop(record.id)
                return record
            record, stop = self.core.pause(key)
            self._send_stop(stop)
            return record

    def resume(self, key: str, reason: str = "resumed by the user") -> JobRecord:
        with self.lock:
            return self.core.resume(key, reason)

    def delete(self, key: str) -> None:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.job_starts:
                raise ValueError(f"job {record.id} is starting; cancel it first")
            self.core.delete(key)
            self.listeners.job_deleted(record.id)

    def trainers(self) -> list[dict[str, Any]]:
        with self.lock:
            return [self._slot_info(s) for s in self.slots.values()]

    def shutdown(self) -> None:
        """Stop the loop and the trainers (their running jobs are paused with a checkpoint and queued
        again for the next start of the service). Events the job table cannot take within a minute are
        written next to it and applied at the next start."""
        self.stopping.set()
        self.thread.join(timeout=30)
        with self.lock:
            refs = {sid: s.handle.shutdown.remote() for sid, s in self.slots.items() if s.status is not None}
            for sid, ref in refs.items():
                try:
                    events = ray.get(ref, timeout=180)
                except RayError as error:
                    log.warning("scheduler: trainer %s did not shut down cleanly: %s", sid, error)
                    continue
                for event in events:
                    if event.kind == "paused" and not event.data.get("retry"):
                        self.core.preempting[event.job_id] = "the service stopped; resumes from its checkpoint"
                self.slots[sid].pending.extend(events)
            deadline = time.monotonic() + 60
            while any(s.pending for s in self.slots.values()) and time.monotonic() < deadline:
                self.table_retry_at = 0.0
                if not self._apply_all_pending():
                    time.sleep(1.0)
            self._spill_unapplied_events()
            for slot in self.slots.values():
                if slot.handle is not None:
                    ray.kill(slot.handle)
            self.job_starts.kill_all()
            self.listeners.close()
            self.table.close()

    # -- the loop -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                with self.lock:
                    self._tick()
            except JobTableBusy as error:   # a decision round the table could not take: nothing of it happened
                log.warning("scheduler: %s; the next round tries again", error)
            except Exception:  # noqa: BLE001 - keep the service alive; the error is logged
                log.exception("scheduler: error in the scheduling loop")
            self.stopping.wait(self.config.tick_seconds)

    def _tick(self) -> None:
        for slot in self.slots.values():
            self._watch(slot)
        if not self._apply_all_pending():
            return   # the table is locked: nothing is decided until what the trainers reported is in it
        self.job_starts.finish(lambda trainer_id, assignments: self.slots[trainer_id].handle.assign.remote(assignments))
        ready = [s.status for s in self.slots.values() if s.status is not None]
        if ready and time.monotonic() >= self.next_round_at:
            started = time.monotonic()
            self._decide_round(ready)
            took = time.monotonic() - started
            self.next_round_at = started + took / ROUND_SHARE if took > ROUND_PACED_FROM_S else 0.0
        self.job_starts.release()
        self._explain_waits()

    def _decide_round(self, ready: list[TrainerStatus]) -> None:
        self.rounds += 1
        with self.table.transaction():   # a round is decided whole or not at all
            actions = self.core.plan(ready)
        for action in actions:
            if isinstance(action, Start):
                self.job_starts.begin(action, self.rounds)
            elif isinstance(action, (Preempt, Move)):   # a move pauses the job first (SchedulerCore.plan)
                record = self.table.get(action.job)
                self._send_stop(StopRequest(action.job, record.trainer or "", "paused", action.reason))
        # the first round after a start tells the listeners of every job (e.g. to publish its retained state)
        jobs = self.table.all(ACTIVE_STATES if self.rounds > 1 else None)
        self.listeners.tick(jobs, self.table.counts(), ready)

    # -- the job table's intake ----------------------------------------------------------------------------
    def _apply_all_pending(self) -> bool:
        """Apply every trainer's waiting events (one transaction per trainer, in order); False while the
        table refuses them (they stay queued and are tried again with backoff)."""
        if not any(slot.pending for slot in self.slots.values()):
            return True
        if time.monotonic() < self.table_retry_at:
            return False
        for slot in self.slots.values():
            if not slot.pending:
                continue
            try:
                self._apply_pending(slot)
            except JobTableBusy as error:
                log.warning("scheduler: %d events of %s wait for the job table: %s; trying again in %.1fs",
                            len(slot.pending), slot.trainer_id, error, self.table_backoff)
                self.table_retry_at = time.monotonic() + self.table_backoff
                self.table_backoff = min(self.table_backoff * 2, TABLE_RETRY_S[1])
                return False
        self.table_backoff = TABLE_RETRY_S[0]
        return True

    def _apply_pending(self, slot: TrainerSlot) -> None:
        """One transaction for the slot's queue; the listeners hear each event once it is committed, in
        the order the trainer reported them (a job's progress before its `completed`)."""
        status = slot.status
        batch = list(slot.pending)
        with self.table.transaction():
            for item in batch:
                if isinstance(item, TrainerLost):
                    for job_id in self.core.trainer_lost(slot.trainer_id, item.why):
                        self.table.after_commit(lambda job_id=job_id: self.job_starts.drop(job_id))
                    continue
                self.core.apply_event(slot.trainer_id, item)
                if status is not None:
                    self.table.after_commit(lambda item=item: self.listeners.trainer_polled(status, [item]))
        for _ in batch:
            slot.pending.popleft()

    def _spill_unapplied_events(self) -> None:
        """Write the events the table could not take to a file beside it (applied at the next start)."""
        left = [(slot.trainer_id, item) for slot in self.slots.values() for item in slot.pending
                if isinstance(item, TrainerEvent)]
        if left:
            path = spill_events(self.state_dir, left)
            log.error("scheduler: the job table stayed locked; %d trainer events were written to %s and are "
                      "applied at the next start", len(left), path)

    def _replay_unapplied_events(self) -> None:
        events = read_spilled_events(self.state_dir)
        if events is None:
            return
        with self.table.transaction():
            for trainer_id, event in events:
                self.core.apply_event(trainer_id, event)
        forget_spilled_events(self.state_dir)
        log.info("scheduler: applied %d trainer events left from the last run", len(events))

    def _launch(self, slot: TrainerSlot) -> None:
        service = ray.get_runtime_context().get_actor_name() or "aspen"
        slot.actor_name = f"{service}.{slot.trainer_id}.{self.incarnation}.{slot.restarts}"
        options: dict[str, Any] = {"num_cpus": slot.config.num_cpus, "num_gpus": slot.config.num_gpus,
                                   "name": slot.actor_name, "namespace": NAMESPACE}
        slot.handle = TrainerActor.options(**options).remote(slot.trainer_id, slot.config.model_dump_json(),
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
        slot.pending.extend(events)   # into the job table by _apply_all_pending, retried while it is locked
        if not events:
            self.listeners.trainer_polled(status, [])

    def _replace(self, slot: TrainerSlot, why: str) -> None:
        """Start a new trainer; its predecessor's jobs are queued again once everything it reported before
        it died is in the table (so that a job it finished is not run again)."""
        log.warning("scheduler: trainer %s lost (%s); starting a new one", slot.trainer_id, why)
        slot.pending.append(TrainerLost(why))
        try:
            ray.kill(slot.handle)
        except RayError as error:
            log.info("scheduler: killing lost trainer %s: %s", slot.trainer_id, error)
        slot.restarts += 1
        self._launch(slot)

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
