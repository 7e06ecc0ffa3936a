"""`SchedulerActor`: the named, long-lived service, a thin Ray shell over the scheduler's Ray-free cores.

It holds the job table (SQLite in its state folder, held by `ServiceState`: actors/service/table/state_dir.py) and
answers the client's calls; its loop thread (`SchedulerLoop`: actors/service/scheduler/scheduler_loop.py, with the
pace of its decision rounds) has the
trainer fleet (`actors/service/scheduler/trainer_fleet.py`: trainers started per node, polled, replaced when they
die, retired when their node leaves) watch the trainers, the event intake (`actors/service/events/event_intake.py`)
book what they reported, and the scheduler core (`actors/service/scheduler/scheduler_core.py`) decide; it starts a
`JobActor` per running job (`actors/job_dispatch.py`). The Ray side of the trainers is `actors/ray_trainers.py`.

Nothing a trainer reports is lost: its events wait until the job table has taken them (retried with
backoff while another process holds the table's file), and those still waiting when the service stops
are written next to the table and applied at its next start. The actor restarts itself when its process
dies (`max_restarts=-1`): the new instance reloads the table, and the jobs that were running resume from
their checkpoints. The scheduler itself runs on the head node (`Client.serve` pins it there), next to its
job table. It also runs the service's sweeps (`actors/service/sweeps/sweep_book.py`): each tick advances them, so a
sweep goes on without whoever submitted it and, its state in the state folder, after a restart."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray

from actors.job_dispatch import JobStarts
from actors.niceness import background_priority
from actors.ray_trainers import RayTrainers
from actors.service.events.event_intake import EventIntake
from actors.service.events.listeners import Listeners, build_listeners
from actors.service.scheduler.call_waits import GENERATE_WAIT_S, TrainerBusy, busy_message, wait_unless_withdrawn
from actors.service.scheduler.chained_jobs import ENDED_WITH_AN_ADAPTER
from actors.service.scheduler.cluster_plan import trainer_kinds
from actors.service.scheduler.config import ServiceConfig
from actors.service.scheduler.held_jobs import HeldJobs, give_back_unheld
from actors.service.scheduler.interactive_jobs import NoRoom
from actors.service.scheduler.scheduler_core import SchedulerCore, StopRequest
from actors.service.scheduler.scheduler_loop import SchedulerLoop
from actors.service.scheduler.trainer_fleet import NODES_READ, READING_NODES, TrainerCallFailed, TrainerFleet
from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.service.table.job_record import adapter_step
from actors.service.table.job_table import ACTIVE_STATES, JobRecord
from actors.service.table.recorded_run import hold_unfinished
from actors.service.table.state_dir import ServiceState
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from actors.spec.job_submission import JobSubmission
from actors.spec.sweep_spec import SweepSpec
from actors.spec.typed_args import expect_type
from actors.storage.s3_settings import configure_storage
from policies.base import Move, Preempt, Start
from policies.registry import load_policy

log = logging.getLogger(__name__)

SHUTDOWN_TABLE_WAIT_S = 60.0   # how long a stopping service tries to book its trainers' last events


@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)
class SchedulerActor:
    def __init__(self, config: ServiceConfig, listeners: str | None = None):
        """`listeners`: 'module:function' that builds the service's listeners from its configuration (the
        client passes `orchestrator.observability:service_listeners`: metrics and MQTT events); None: none.
        Named, not imported here, so that this layer does not depend on the user-facing one above it. Specs
        and settings arrive as the validated objects their caller built (pydantic models pickle without being
        validated again); the job table keeps each submission as JSON, read back when needed."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        background_priority()   # light work next to the trainers' torch threads (actors/niceness.py)
        self.config = expect_type(config, ServiceConfig, "the service's configuration")
        configure_storage(self.config.storage.settings())   # and each trainer and job actor it starts
        self.state = ServiceState(Path(self.config.state_dir).expanduser().resolve())
        state_dir = self.state.path
        incarnation = f"{int(time.time() * 1000):x}"
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.listeners = Listeners(build_listeners(listeners, self.config))
        self.table = self.state.open_table(self.listeners.job_changed)
        trainers = RayTrainers(incarnation, str(state_dir), self.config.policy, self.config.storage,
                               self.config.cluster_poll_s)
        # the live nodes are read off the service's lock (NodeReader), the first read too; only the default kinds,
        # which depend on whether the cluster has GPUs, wait for it here
        nodes = None if self.config.trainers else trainers.nodes(fresh=True)
        trainers.nodes()   # the first read (of configured kinds) under way: the first ticks follow its answer
        kinds = trainer_kinds(self.config, any(node.gpus >= 1 for node in nodes or []))
        self.core = SchedulerCore(self.table, load_policy(self.config.policy), state_dir,
                                  on_decision=self.listeners.decided, trainers=kinds,
                                  output_root=self.config.output_root, data_roots=self.config.data_roots,
                                  fair_share_window_s=self.config.fair_share_window_s,
                                  user_functions=self.config.user_functions,
                                  policy_timeout_s=self.config.policy_timeout_s)
        self.lock = threading.RLock()
        self.intake = EventIntake(self.table, self.core, state_dir, on_events=self._booked,
                                  on_requeued=lambda job_id: self.job_starts.drop(job_id))
        self.fleet = TrainerFleet(kinds, trainers, self.intake, trainer_timeout_s=self.config.trainer_timeout_s,
                                  cluster_poll_s=self.config.cluster_poll_s,
                                  on_polled=lambda status: self.listeners.trainer_polled(status, []))
        self.intake.replay()
        recovered = self.core.recover(resume=self.config.resume_on_start or restarted)
        if recovered:
            log.info("scheduler: %d unfinished jobs %s", len(recovered),
                     "will resume from their checkpoints" if self.config.resume_on_start or restarted
                     else "are held until resumed")
        if nodes is not None:
            self.fleet.follow(nodes)
        self.job_starts = JobStarts(self.table, self.core, state_dir, node_of=self.fleet.node_of,
                                    storage=self.config.storage)
        self.core.node_of = self.fleet.node_of
        self.sweeps = SweepBook(state_dir, SchedulerJobs(self.core, self.table, self.cancel))
        self.held = HeldJobs()
        self.loop = SchedulerLoop(self._tick, self.lock, self.config.tick_seconds)
        self.loop.start()

    # -- client calls ---------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self.lock:
            info = {"state_dir": str(self.state.path), "policy": self.core.policy.name,
                    "output_root": str(root) if (root := self.core.submissions.relative_root) else None,
                    "trainers": self.fleet.describe(), "job_slots": dict(self.core.job_slots),
                    **self.listeners.describe(), **self.core.guard.describe()}
            waiting = self.intake.waiting()
            if waiting:
                why = self.intake.refused or "it is locked"
                info["table_error"] = f"{waiting} trainer events wait for the job table ({why}); retrying"
            if none := self.fleet.unplanned():   # kinds no node holds have no trainer: `aspen serve` lists it
                info["trainers_error"] = none
            if not self.fleet.nodes_read:   # the first read of the cluster's nodes has not answered: none planned yet
                info["nodes"] = READING_NODES
            return info

    def trainer_phase(self, trainer_id: str, phase: str) -> None:
        """A trainer's set-up began `phase` (loading its base, warming up, ...): `info()` shows it until ready."""
        with self.lock:
            self.fleet.note_phase(trainer_id, phase)

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Block until every trainer has loaded its model, failed to, or is known unplaceable (its description's
        `unplaceable`: no node holds it and no autoscaler may add one; `TrainerFleet.all_settled`)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if self.fleet.all_settled():
                    return self.info()
            time.sleep(0.1)
        waiting = "; ".join(f"{t['id']}: {t['phase']}" for t in self.info()["trainers"] if not t["ready"])
        raise TimeoutError(f"trainers not ready after {timeout:.0f}s: {waiting}")

    def submit(self, submission: JobSubmission) -> JobRecord:
        return self.submit_many([submission])[0]

    def submit_many(self, submissions: list[JobSubmission], job_ids: list[str] | None = None) -> list[JobRecord]:
        """Jobs submitted together start together (one decision round; see `Submissions.submit_many`).
        All or none: a bad one is named and nothing is entered."""
        for index, submission in enumerate(submissions):
            expect_type(submission, JobSubmission, f"submission {index + 1} of {len(submissions)}")
        with self.lock:
            return self.core.submit_many(list(submissions), job_ids)

    def check_submissions(self, submissions: list[JobSubmission]) -> None:
        """What `submit_many` would refuse of these submissions, with nothing entered (`Submissions.check`)."""
        for index, submission in enumerate(submissions):
            expect_type(submission, JobSubmission, f"submission {index + 1} of {len(submissions)}")
        with self.lock:
            self.core.submissions.check(list(submissions))

    def submission(self, key: str) -> JobSubmission:
        """The job's submission as stored, e.g. to compare a jobs file against it."""
        with self.lock:
            return self.table.submission(self.table.find(key).id)

    def jobs(self, states: tuple[str, ...] | None = None, limit: int | None = None,
             after: tuple[float, str] | None = None, owner: str | None = None) -> list[JobRecord]:
        """The jobs (`JobTable.all`): in `states`, a page of `limit` after the cursor `after`, `owner`'s only."""
        with self.lock:
            return self.table.all(states, limit=limit, after=after, user=owner)

    def status(self, key: str) -> JobRecord:
        with self.lock:
            return self.table.find(key)

    def progress(self, key: str) -> list[dict[str, Any]]:
        with self.lock:
            return self.table.progress.of_job(self.table.find(key).id)

    def transitions(self, key: str) -> list[tuple[float, str, str]]:
        with self.lock:
            return self.table.transitions.of_job(self.table.find(key).id)

    def transitions_after(self, after: int | None, limit: int = 1000) -> tuple[int, list[dict[str, Any]]]:
        """The newest transition's number and the transitions after `after` (None: none, only the number),
        as `JobTable.transitions_after`: what the HTTP API's event stream follows."""
        with self.lock:
            return self.table.transitions.last(), ([] if after is None else self.table.transitions.after(after, limit))

    def cancel(self, key: str, reason: str = "cancelled by the user") -> JobRecord:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.job_starts:       # not on its trainer yet
                record = self.table.set_state(record.id, "cancelled", reason, trainer=None)
                self.job_starts.drop(record.id)
                return record
            if self.core.is_interactive(record.id) and not record.finished:
                return self.close_interactive(record.id, "cancelled", reason)
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

    def extend(self, key: str, submission: JobSubmission, reason: str = "its budget raised") -> JobRecord:
        with self.lock:
            return self.core.extend(key, submission, reason)

    def generate(self, key: str, prompt: str, max_new_tokens: int, ticket: str | None = None) -> dict[str, Any]:
        """"Try it": `prompt` continued by the job's adapter and by the base alone, on a trainer between two steps
        (actors/service/trainer/try_adapter.py): a running job's current adapter on its trainer, a finished job's
        saved one on a trainer holding its base. ValueError for a job with neither. `ticket`: the caller's, by which
        it may withdraw the call (`withdraw_try`); `Withdrawn` (a ValueError) once it has."""
        ticket = self.fleet.tries.open(ticket)   # closed when this call returns: a trainer not running it by then won't
        withdrawn = self.fleet.tries.withdrawn(ticket)
        try:
            with self.lock:
                record = self.table.find(key)
                if record.state == "running" and record.trainer is not None:
                    call = self.fleet.generate(record.trainer, record.id, prompt, max_new_tokens, ticket)
                elif record.state in ENDED_WITH_AN_ADAPTER and record.adapter_dir:
                    call = self.fleet.try_saved(record.id, self.table.submission(record.id).job,
                                                (record.base_model, record.quantization), record.adapter_dir,
                                                adapter_step(record), prompt, max_new_tokens, ticket)
                else:
                    raise ValueError(f"job {record.id} is {record.state}: only a running job's adapter, or the one a "
                                     "job ended with (completed or stopped early), can be tried")
            # outside the lock: the service answers meanwhile
            return wait_unless_withdrawn(call, withdrawn, GENERATE_WAIT_S)
        except TrainerCallFailed as error:
            if isinstance(error.cause, ValueError):   # the request's (not on its steps now, a bad prompt)
                raise ValueError(str(error.cause.args[0] if error.cause.args else error.cause)) from None
            where = f"trainer {record.trainer}" if record.state == "running" else "the trainer holding its base"
            if error.kind == "GetTimeoutError":   # queued behind its step, or generating still
                raise TrainerBusy(busy_message(where, GENERATE_WAIT_S)) from None
            raise RuntimeError(f"{where} could not generate: {error}") from None
        finally:
            self.fleet.tries.close(ticket)

    def try_waited(self, ticket: str) -> bool:
        """Whether the "try it" of `ticket` is still waited for (its trainer asks before running it; without the
        lock, which a call waiting for its trainer does not hold)."""
        return self.fleet.tries.waited(ticket)

    def withdraw_try(self, ticket: str) -> bool:
        """Its caller no longer waits for the "try it" of `ticket` (the HTTP API's client disconnected): the call's
        wait ends, its trainer drops it or stops generating it. Whether a call held it (without the lock)."""
        return self.fleet.tries.withdraw(ticket)

    def delete(self, key: str) -> None:
        with self.lock:
            record = self.table.find(key)
            if record.id in self.job_starts:
                raise ValueError(f"job {record.id} is starting; cancel it first")
            self.core.delete(key)
            self.listeners.job_deleted(record.id)

    # -- interactive models (the Tinker API's; actors/service/scheduler/interactive_jobs.py) -----------------
    def open_interactive(self, model_id: str, base_model: str, rank: int, user: str | None,
                         train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = False
                         ) -> dict[str, Any]:
        """Enter a model as a running job on a single-device trainer holding `base_model` with the room for it:
        {job, trainer, handle (the trainer actor's), output_dir}. ValueError: no trainer holds that base;
        NoRoom: none has the room now."""
        with self.lock:
            candidates = [s for s in self.fleet.ready_statuses() if self.fleet.single_device(s.trainer_id)]
            with self.table.transaction():
                opened = self.core.interactive.open(model_id, base_model, rank, user, candidates,
                                                    train_attn=train_attn, train_mlp=train_mlp,
                                                    train_unembed=train_unembed,
                                                    standing=self.core.standing().get(user))
            return {"job": opened.record.id, "trainer": opened.trainer, "output_dir": opened.record.output_dir,
                    "handle": self.fleet.handle_of(opened.trainer)}

    def reopen_interactive(self, job_id: str, lost_trainer: str) -> dict[str, Any]:
        """Place a model whose trainer was lost again: {job, trainer, handle, output_dir}, as `open_interactive`
        (NoRoom: its job says why it waits)."""
        with self.lock:
            candidates = [s for s in self.fleet.ready_statuses() if self.fleet.single_device(s.trainer_id)]
            try:
                with self.table.transaction():
                    opened = self.core.interactive.reopen(job_id, lost_trainer, candidates,
                                                          standing=self.core.standing().get(
                                                              self.table.get(job_id).user))
            except NoRoom as waits:
                self.core.interactive.waits(job_id, str(waits))
                raise
            return {"job": opened.record.id, "trainer": opened.trainer, "output_dir": opened.record.output_dir,
                    "handle": self.fleet.handle_of(opened.trainer)}

    def close_interactive(self, job_id: str, state: str, reason: str, adapter_dir: str | None = None) -> JobRecord:
        """End a model's job, its model closed on its trainer (once left open there, holding memory, if failed)."""
        with self.lock:
            record = self.table.get(job_id)
            if (handle := None if record.finished else self.fleet.handle_of(record.trainer or "")) is not None:
                handle.tinker_close_job.remote(job_id)
            return self.core.interactive.close(job_id, state, reason, adapter_dir)

    def interactive_trainer(self, base_model: str) -> dict[str, Any]:
        """A ready single-device trainer holding `base_model` (sampling the base alone): {trainer, handle}."""
        with self.lock:
            for status in self.fleet.ready_statuses():
                if status.base_model == base_model and self.fleet.single_device(status.trainer_id):
                    return {"trainer": status.trainer_id, "handle": self.fleet.handle_of(status.trainer_id)}
        raise ValueError(f"base model '{base_model}' is not held by a ready trainer that takes interactive models")

    def trainers(self) -> list[dict[str, Any]]:
        with self.lock:
            return self.fleet.describe()

    # -- sweeps ---------------------------------------------------------------------------------------------
    def submit_sweep(self, spec: SweepSpec) -> dict[str, Any]:
        """Take a sweep (a validated `SweepSpec`); its first trials start at the next tick."""
        expect_type(spec, SweepSpec, "the sweep")
        with self.lock:
            if spec.user is not None:   # its user's trials may read its data: refused now, not at its first trial
                self.core.submissions.check_reader(spec.job, spec.user)
            return self.sweeps.add(spec)

    def check_sweep(self, spec: SweepSpec) -> bool:
        """What `submit_sweep` would refuse of `spec`, nothing added (the HTTP API asks before it reads the sweep's
        data rows); True where it would be a new sweep (False: the same sweep as one known, which it answers with)."""
        expect_type(spec, SweepSpec, "the sweep")
        with self.lock:
            if spec.user is not None:
                self.core.submissions.check_reader(spec.job, spec.user)
            return self.sweeps.check(spec)

    def sweep(self, name: str) -> dict[str, Any]:
        with self.lock:
            return self.sweeps.status(name)

    def sweeps_list(self) -> list[dict[str, Any]]:
        with self.lock:
            return self.sweeps.all()

    def accounts(self) -> list[dict[str, Any]]:
        """What each user's jobs used (`JobTable.accounts`): jobs, trained tokens, step-seconds, GPU-seconds."""
        return [{"user": user, **usage} for user, usage in self.table.usage.accounts().items()]

    def cancel_sweep(self, name: str) -> dict[str, Any]:
        with self.lock:
            return self.sweeps.cancel(name)

    def shutdown(self, hold: bool | str = False) -> None:
        """Stop the loop and the trainers (their running jobs are paused with a checkpoint and queued
        again for the next start of the service; with `hold`, `aspen run`'s service, they and the queued ones are
        paused, saying that the same command continues them; a str: what continues them, as `{step}` there). Events
        the job table cannot take within a minute are written next to it and applied at the next start."""
        self.loop.stop()
        with self.lock:
            for trainer_id, events in self.fleet.shutdown():
                for event in events:
                    if event.kind == "paused" and not event.data.get("retry"):
                        self.core.booking.expect_pause(event.job_id, "the service stopped; resumes from its "
                                                                     "checkpoint")
                self.intake.put(trainer_id, events)
            drained = self.intake.drain(SHUTDOWN_TABLE_WAIT_S)
            try:
                if drained and hold:   # `aspen run`'s own: held as its in-process run holds them
                    hold_unfinished(self.table, self.core.is_interactive, *([hold] if isinstance(hold, str) else []))
                self.intake.spill()   # EventsLost, where its file cannot be written: raised once all is stopped
            finally:
                self.fleet.kill_all()
                self.job_starts.kill_all()
                self.listeners.close()
                self.state.close()   # the table, and its last backup

    # -- the loop -----------------------------------------------------------------------------------------
    def _tick(self) -> None:
        self.fleet.follow_if_due()
        self.fleet.watch_all()
        if not self.intake.apply_all():
            return   # the table is locked: nothing is decided until what the trainers reported is in it
        for trainer_id in self.fleet.drop_retired():   # gone for good (a node that joins gets a new id)
            self.listeners.trainer_retired(trainer_id)
        self._give_back_unheld()
        self.job_starts.finish(self.fleet.assign)
        ready = self.fleet.ready_statuses()
        # running jobs each node holds: their actors' processes within its memory (ServiceConfig.job_slots)
        self.core.job_slots = {node.id: self.config.job_slots(node.memory_bytes) for node in self.fleet.nodes.values()
                               if node.memory_bytes > 0 or self.config.job_processes_per_node is not None}
        if ready:   # a decision round, at its pace (scheduler_loop.ROUND_SHARE)
            self.loop.paced_round(lambda round_number: self._decide_round(ready, round_number))
        self.job_starts.release()
        self._explain_waits()
        if self.sweeps.drivers:
            self.sweeps.poll_all()
            self.listeners.sweeps(self.sweeps.all())

    def _give_back_unheld(self) -> None:
        """Running jobs their trainer stopped holding without reporting their end: queued again
        (actors/service/scheduler/held_jobs.py). Every event received is booked by now."""
        give_back_unheld(self.held, self.core.booking, self.fleet.ready_statuses(),
                         lambda job_id: job_id in self.job_starts or self.core.is_interactive(job_id))

    def _decide_round(self, ready: list[TrainerStatus], round_number: int) -> None:
        """The round carried out (its wait for the policy, the lock released, is paced apart: scheduler_loop.py)."""
        # its snapshot and its decisions each written whole or not at all; the policy decides with the service's
        # lock released (SchedulerCore.plan), so that no user's call waits for a slow policy
        actions = self.core.plan(ready, self.loop.unlocked)
        for action in actions:
            if isinstance(action, Start):
                self.job_starts.begin(action, round_number)
            elif isinstance(action, (Preempt, Move)):   # a move pauses the job first (SchedulerCore.plan)
                record = self.table.get(action.job)
                self.fleet.stop_job(record.trainer or "", action.job, "paused", action.reason)
        # the first round after a start tells the listeners of every job (e.g. to publish its retained state)
        jobs = self.table.all(ACTIVE_STATES if round_number > 1 else None)
        self.listeners.tick(jobs, self.table.counts(), ready)
        self.listeners.accounts(self.table.usage.ever_used())   # deleted jobs' included: counters never go down

    def _booked(self, trainer_id: str, events: list[TrainerEvent]) -> None:
        """Events are in the table: the listeners hear them with their trainer's status (none once retired)."""
        status = self.fleet.status_of(trainer_id)
        if status is not None:
            self.listeners.trainer_polled(status, events)

    def _explain_waits(self) -> None:
        was_reading = READING_NODES in self.core.trainer_waits.values()   # the nodes' first read: said till it answered
        self.core.trainer_waits = self.fleet.waits_by_base()   # the next round's reason for their jobs
        why = self.fleet.why_none_runs() or (NODES_READ if was_reading and self.fleet.nodes_read else None)
        if why is None:
            return
        for record in self.table.all(("queued",)):
            self.table.set_reason(record.id, why)

    def _send_stop(self, stop: StopRequest | None) -> None:
        if stop is not None:
            self.fleet.stop_job(stop.trainer, stop.job, stop.kind, stop.reason)

