"""`SchedulerActor`: the named, long-lived service. It holds the job table (SQLite in its state folder),
starts and watches the trainers, starts a `JobActor` per running job, and assigns queued jobs to trainers
with its policy. A loop thread polls the trainers (their events carry progress and job endings) and
replaces a trainer that died; the jobs it held resume elsewhere from their checkpoints.

Nothing a trainer reports is lost: polled events wait in a queue per trainer until the job table has taken
them (one transaction per batch, retried with backoff while another process holds the table's file), and
the events still waiting when the service stops are written next to the table and applied at its next
start. The actor restarts itself when its process dies (`max_restarts=-1`): the new instance reloads the
table, and the jobs that were running resume from their checkpoints.

The trainers follow the cluster (`actors/service/cluster_plan.py`): every `cluster_poll_s` the scheduler
reads the live nodes, starts the planned trainers that do not run yet (each pinned to its node, its threads
sized from that node) and retires those whose node left; a retired trainer's jobs are queued again and
resume from their last checkpoints on another trainer, each with a new job actor (job actors run on their
trainer's node where they can). The scheduler itself runs on the head node (`Client.serve` pins it
there), next to its job table."""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.engine.spec import JobSubmission
from actors.engine.storage import configure_storage
from actors.job_starts import JobStarts
from actors.niceness import background_priority
from actors.service.cluster_plan import NodeInfo, TrainerKey, plan_trainers, trainer_kinds
from actors.service.config import NAMESPACE, ServiceConfig, TrainerConfig
from actors.service.job_fit import trainer_view
from actors.service.job_table import ACTIVE_STATES, JobRecord, JobTableBusy
from actors.service.listeners import Listeners
from actors.service.scheduler_core import SchedulerCore, StopRequest, SubmissionError
from actors.service.state_dir import (
    forget_spilled_events,
    lock_state_dir,
    open_job_table,
    read_spilled_events,
    spill_events,
)
from actors.service.trainer_reports import TrainerEvent, TrainerStatus
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
    key: TrainerKey = ()
    node: str | None = None       # the node it is pinned to
    retired: bool = False         # its node left the cluster: gone once its last events are in the table
    unavailable_since: float = 0.0   # monotonic time of its first ActorUnavailableError in a row (0: none)
    handle: Any = None
    ready_ref: Any = None
    poll_ref: Any = None
    poll_sent: float = 0.0
    status: TrainerStatus | None = None
    error: str | None = None
    restarts: int = 0
    actor_name: str = ""
    pending: deque = field(default_factory=deque)   # TrainerEvent | TrainerLost not yet in the job table


# A trainer Ray reports unavailable (its node dying, a network hiccup) is asked again this long before it
# is replaced; a node Ray declares dead meanwhile retires it at once.
UNAVAILABLE_GRACE_S = 60.0
TABLE_RETRY_S = (0.5, 10.0)     # backoff between tries to write what the job table could not take
# A decision round (snapshot, policy, listeners) may take at most this share of the scheduler's time, so
# that a submission rarely waits behind one: with thousands of queued jobs rounds come less often than
# tick_seconds (a 40 ms round: every 2 s). Trainer events are still taken every tick.
ROUND_SHARE = 0.02
ROUND_PACED_FROM_S = 0.01   # rounds shorter than this (a table of tens of jobs) run every tick


def alive_nodes() -> list[NodeInfo]:
    """The cluster's live nodes, the head first."""
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        nodes.append(NodeInfo(node["NodeID"], node.get("NodeManagerAddress", ""), float(resources.get("CPU", 0)),
                              float(resources.get("GPU", 0)), "node:__internal_head__" in resources))
    return sorted(nodes, key=lambda n: (not n.head, n.id))


def head_node_id() -> str | None:
    """The head node of the cluster this process is connected to (where the service's scheduler lives)."""
    return next((node.id for node in alive_nodes() if node.head), None)


def short_node(node_id: str | None) -> str:
    return node_id[:8] if node_id else "(any)"


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
        configure_storage(self.config.storage.settings())   # and each trainer and job actor it starts
        self.state_dir = Path(self.config.state_dir).expanduser().resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_lock = lock_state_dir(self.state_dir)
        self.incarnation = f"{int(time.time() * 1000):x}"
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.listeners = Listeners(build_listeners(listeners, self.config))
        self.table = open_job_table(self.state_dir / "jobs.sqlite", self.listeners.job_changed)
        output_root = self.config.output_root
        nodes = alive_nodes()
        self.kinds = trainer_kinds(self.config, any(node.gpus >= 1 for node in nodes))
        self.core = SchedulerCore(self.table, load_policy(self.config.policy), self.state_dir,
                                  on_decision=self.listeners.decided, trainers=self.kinds,
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
        self.next_trainer = 0
        self.nodes: dict[str, NodeInfo] = {}
        self.nodes_seen_at = 0.0
        self._follow_cluster(nodes)
        if not self.slots:
            log.warning("scheduler: no node of the cluster has the resources of a trainer (%s); jobs wait until "
                        "one joins", ", ".join(f"{n.address}: {n.cpus:g} CPU, {n.gpus:g} GPU" for n in nodes))
        self.job_starts = JobStarts(self.table, self.core, self.state_dir, node_of=self._node_of,
                                    storage_json=self.config.storage.model_dump_json())
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

    def transitions_after(self, after: int | None, limit: int = 1000) -> tuple[int, list[dict[str, Any]]]:
        """The newest transition's number and the transitions after `after` (None: none, only the number),
        as `JobTable.transitions_after`: what the HTTP API's event stream follows."""
        with self.lock:
            return self.table.last_transition(), ([] if after is None else self.table.transitions_after(after, limit))

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
            refs = {sid: s.handle.shutdown.remote() for sid, s in self.slots.items()
                    if s.status is not None and not s.retired}
            for sid, ref in refs.items():
                try:
                    events = ray.get(ref, timeout=180)
                except RayError as error:
                    log.warning("scheduler: trainer %s did not shut down cleanly: %s", sid, error)
                    continue
                for event in events:
                    if event.kind == "paused" and not event.data.get("retry"):
                        self.core.booking.expect_pause(event.job_id,
                                                       "the service stopped; resumes from its checkpoint")
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
            except Exception:  # keep the service alive; the error is logged
                log.exception("scheduler: error in the scheduling loop")
            self.stopping.wait(self.config.tick_seconds)

    def _tick(self) -> None:
        if time.monotonic() - self.nodes_seen_at >= self.config.cluster_poll_s:
            self._follow_cluster(alive_nodes())
        for slot in list(self.slots.values()):
            self._watch(slot)
        if not self._apply_all_pending():
            return   # the table is locked: nothing is decided until what the trainers reported is in it
        for slot in [s for s in self.slots.values() if s.retired and not s.pending]:
            del self.slots[slot.trainer_id]
        self.job_starts.finish(self._assign)
        ready = [s.status for s in self.slots.values() if s.status is not None and not s.retired]
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

    # -- the trainers, following the cluster ---------------------------------------------------------------
    def _follow_cluster(self, nodes: list[NodeInfo]) -> None:
        """Start the planned trainers that are not running, move `any` trainers off nodes that left, retire
        the trainers of nodes that left (their jobs resume elsewhere)."""
        self.nodes_seen_at = time.monotonic()
        live = {node.id for node in nodes}
        if self.nodes:
            for node in nodes:
                if node.id not in self.nodes:
                    log.info("scheduler: node %s (%s) joined the cluster", short_node(node.id), node.address)
        for node_id, node in self.nodes.items():
            if node_id not in live:
                log.warning("scheduler: node %s (%s) left the cluster", short_node(node_id), node.address)
        self.nodes = {node.id: node for node in nodes}
        running = {slot.key: slot for slot in self.slots.values() if not slot.retired}
        plan = plan_trainers(self.kinds, nodes, {key: slot.node for key, slot in running.items()})
        for planned in plan:
            slot = running.pop(planned.key, None)
            if slot is None:
                slot = TrainerSlot(f"trainer-{self.next_trainer}", planned.config, planned.threads, key=planned.key,
                                   node=planned.node)
                self.next_trainer += 1
                self.slots[slot.trainer_id] = slot
                self._launch(slot)
                log.info("scheduler: %s starts on node %s (%s threads)", slot.trainer_id, short_node(slot.node),
                         slot.threads or "default")
            elif slot.node != planned.node:   # an `any` trainer whose node left: started on a live one
                lost_node = slot.node
                slot.node, slot.threads = planned.node, planned.threads
                self._replace(slot, f"its node {short_node(lost_node)} left the cluster")
        for slot in running.values():      # planned no more: its node left
            self._retire(slot, f"its node {short_node(slot.node)} left the cluster")

    def _retire(self, slot: TrainerSlot, why: str) -> None:
        log.warning("scheduler: trainer %s retired (%s); its jobs resume on other trainers", slot.trainer_id, why)
        slot.pending.append(TrainerLost(why))
        slot.retired, slot.status, slot.poll_ref, slot.ready_ref = True, None, None, None
        try:
            ray.kill(slot.handle)
        except RayError as error:
            log.info("scheduler: killing retired trainer %s: %s", slot.trainer_id, error)

    def _node_left(self, slot: TrainerSlot) -> bool:
        """Whether the slot's node has left the cluster (looked up now); if so the trainers follow."""
        if slot.node is None:
            return False
        nodes = alive_nodes()
        if any(node.id == slot.node for node in nodes):
            return False
        self._follow_cluster(nodes)
        return True

    def _node_of(self, trainer_id: str) -> str | None:
        slot = self.slots.get(trainer_id)
        return slot.node if slot is not None else None

    def _assign(self, trainer_id: str, assignments: list[tuple]) -> None:
        slot = self.slots.get(trainer_id)
        if slot is None or slot.retired:
            return   # its jobs were queued again when it was retired
        slot.handle.assign.remote(assignments)

    def _launch(self, slot: TrainerSlot) -> None:
        service = ray.get_runtime_context().get_actor_name() or "aspen"
        slot.actor_name = f"{service}.{slot.trainer_id}.{self.incarnation}.{slot.restarts}"
        options: dict[str, Any] = {"num_cpus": slot.config.num_cpus, "num_gpus": slot.config.num_gpus,
                                   "name": slot.actor_name, "namespace": NAMESPACE}
        if slot.node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node, soft=False)
        slot.handle = TrainerActor.options(**options).remote(slot.trainer_id, slot.config.model_dump_json(),
                                                               str(self.state_dir), slot.threads, self.config.policy,
                                                               storage_json=self.config.storage.model_dump_json())
        slot.ready_ref = slot.handle.start.remote()
        slot.poll_ref, slot.status, slot.error = None, None, None

    def _watch(self, slot: TrainerSlot) -> None:
        if slot.error or slot.retired:
            return
        if slot.status is None:
            if not ray.wait([slot.ready_ref], timeout=0)[0]:
                return
            try:
                slot.status = ray.get(slot.ready_ref)
                log.info("scheduler: %s ready (%s)", slot.trainer_id, slot.status.base_model)
            except RayError as error:
                if self._node_left(slot):
                    return
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
        except ActorUnavailableError as error:
            # its node may be dying (Ray has not declared it dead yet) or the network hiccupped: ask again
            # until the node is known lost (the trainer is retired) or UNAVAILABLE_GRACE_S have passed
            slot.poll_ref = None
            slot.unavailable_since = slot.unavailable_since or time.monotonic()
            if self._node_left(slot):
                return
            if time.monotonic() - slot.unavailable_since > UNAVAILABLE_GRACE_S:
                self._replace(slot, f"{type(error).__name__} for {UNAVAILABLE_GRACE_S:.0f}s")
            return
        except (RayActorError, GetTimeoutError, RayError) as error:
            self._replace(slot, type(error).__name__)
            return
        slot.poll_ref, slot.unavailable_since = None, 0.0
        slot.status = status
        slot.pending.extend(events)   # into the job table by _apply_all_pending, retried while it is locked
        if not events:
            self.listeners.trainer_polled(status, [])

    def _replace(self, slot: TrainerSlot, why: str) -> None:
        """Start a new trainer; its predecessor's jobs are queued again once everything it reported before
        it died is in the table (so that a job it finished is not run again). A trainer whose node left the
        cluster is retired instead (or, of an `any` kind, started on a live node)."""
        if not why.startswith("its node") and self._node_left(slot):
            return
        log.warning("scheduler: trainer %s lost (%s); starting a new one", slot.trainer_id, why)
        slot.pending.append(TrainerLost(why))
        try:
            ray.kill(slot.handle)
        except RayError as error:
            log.info("scheduler: killing lost trainer %s: %s", slot.trainer_id, error)
        slot.restarts += 1
        slot.unavailable_since = 0.0
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
        node = self.nodes.get(slot.node or "")
        info: dict[str, Any] = {"id": slot.trainer_id, "base_model": slot.config.base_model,
                                "quantization": slot.config.quantization, "error": slot.error,
                                "restarts": slot.restarts, "ready": slot.status is not None,
                                "actor_name": slot.actor_name, "node_id": slot.node,
                                "node_address": node.address if node else None, "threads": slot.threads,
                                "retired": slot.retired}
        if slot.status is not None:
            status = asdict(slot.status)
            status.pop("linear_shapes")
            info.update(status)
            view = trainer_view(slot.status)
            info.update(memory_fixed_bytes=view.base_bytes, memory_step_bytes=view.step_memory_bytes)
        return info
