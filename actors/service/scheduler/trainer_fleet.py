"""The service's trainers, supervised without Ray: started on the nodes the plan gives them, polled,
replaced when lost, retired when their node leaves the cluster.

The trainers follow the cluster (`cluster_plan.py`): every `cluster_poll_s` the fleet reads the live nodes,
starts the planned trainers that do not run yet (each pinned to its node, its threads sized from that node)
and retires those whose node left. A retired or replaced trainer's jobs are queued again once everything it
reported is in the job table, and resume from their last checkpoints, each with a new job actor (job actors
run on their trainer's node where they can: `actors/job_dispatch.py`). The Ray calls sit behind
`TrainerHandles` (`trainer_handles.py`), which the scheduler actor provides (`actors/ray_trainers.py`); what a
trainer reports goes to the event intake (`event_intake.py`), a lost trainer as a `TrainerLost` after its last
events. Whether Ray can place a trainer, and what the service says of those that do not run, is kept by
`fleet_placement.py`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from actors.service.events.event_intake import EventIntake, TrainerLost
from actors.service.scheduler.call_waits import WaitedTries
from actors.service.scheduler.cluster_plan import NodeInfo, TrainerKey, plan_trainers
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.fleet_placement import Placement, all_settled, unplanned, waits_by_base, why_none_runs
from actors.service.scheduler.job_fit import trainer_view
from actors.service.scheduler.trainer_handles import TrainerCall, TrainerCallFailed, TrainerHandles, TrainerUnavailable
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from actors.spec.job_spec import JobSpec

log = logging.getLogger(__name__)

# A trainer Ray reports unavailable (its node dying, a network hiccup) is asked again this long before it
# is replaced; a node Ray declares dead meanwhile retires it at once.
UNAVAILABLE_GRACE_S = 60.0
# until the first read of the live nodes answers (it runs off the service's lock: actors/ray_trainers.py NodeReader),
# what the fleet says instead of a plan it cannot make yet (never "no node fits")
READING_NODES = "reading the cluster's nodes from Ray's GCS (no answer yet); trainers start once it answers"
NODES_READ = "waiting for the service's trainers to start (the cluster's nodes are read)"   # once READING_NODES ended


def short_node(node_id: str | None) -> str:
    return node_id[:8] if node_id else "(any)"


@dataclass
class TrainerSlot:
    """One planned trainer: the actor running it now (replaced when lost) and what it last reported."""

    trainer_id: str
    config: TrainerConfig
    threads: int | None
    key: TrainerKey = ()
    ram_share: float = 1.0        # of its node's RAM, for a CPU trainer's default budget (cluster_plan.py)
    node: str | None = None       # the node it is pinned to
    retired: bool = False         # its node left the cluster: gone once its last events are in the table
    unavailable_since: float = 0.0   # clock time of its first TrainerUnavailable in a row (0: none)
    handle: Any = None
    ready: TrainerCall | None = None
    poll: TrainerCall | None = None
    poll_sent: float = 0.0
    status: TrainerStatus | None = None
    error: str | None = None
    restarts: int = 0
    actor_name: str = ""
    phase: str = ""               # what its set-up is doing (loading the base, warming up, ...), until ready
    placement: Placement = field(default_factory=Placement)   # why Ray cannot place it now (fleet_placement.py)


class TrainerFleet:
    """The trainers of a service (called under the scheduler's lock)."""

    def __init__(self, kinds: Sequence[TrainerConfig], handles: TrainerHandles, intake: EventIntake, *,
                 trainer_timeout_s: float, cluster_poll_s: float,
                 on_polled: Callable[[TrainerStatus], None] = lambda status: None,
                 clock: Callable[[], float] = time.monotonic):
        """`trainer_timeout_s`: a poll unanswered this long replaces its trainer. `cluster_poll_s`: how often
        `follow_if_due` reads the live nodes. `on_polled(status)`: hears a poll that brought no events
        (events are heard once the table has them, `EventIntake.on_events`). `clock`: monotonic seconds."""
        self.kinds = list(kinds)
        self.handles = handles
        self.intake = intake
        self.trainer_timeout_s = trainer_timeout_s
        self.cluster_poll_s = cluster_poll_s
        self.on_polled = on_polled
        self.clock = clock
        self.slots: dict[str, TrainerSlot] = {}
        self.next_trainer = 0
        self.nodes: dict[str, NodeInfo] = {}
        self.nodes_seen_at: float | None = None   # None: no read of the live nodes has answered (READING_NODES)
        self.tries = WaitedTries()   # the "try it" calls waited for: a trainer runs no other (call_waits.py)

    # -- what the scheduler asks ------------------------------------------------------------------------
    @property
    def nodes_read(self) -> bool:
        """Whether a read of the cluster's live nodes has answered (until then no trainer is planned)."""
        return self.nodes_seen_at is not None

    def ready_statuses(self) -> list[TrainerStatus]:
        return [s.status for s in self.slots.values() if s.status is not None and not s.retired]

    def all_settled(self) -> bool:
        """Whether the wait for the trainers may end (each ready, failed, retired or known unplaceable:
        fleet_placement.py); not before the cluster's nodes are read (no trainer is planned yet)."""
        return self.nodes_read and all_settled(self.slots.values())

    def waits_by_base(self) -> dict[tuple[str, str], str]:
        """Why the jobs of a base model and quantization that no trainer holds or loads wait (fleet_placement.py)."""
        if not self.nodes_read:
            return {(kind.base_model, kind.quantization): READING_NODES for kind in self.kinds}
        return waits_by_base(list(self.slots.values()), self.kinds, list(self.nodes.values()))

    def unplanned(self) -> str | None:
        """Why kinds that no live node holds have no trainer (the service's `trainers_error`; fleet_placement.py); None
        before the cluster's nodes are read (none is known not to hold them)."""
        return None if not self.nodes_read else unplanned(self.slots.values(), self.kinds, list(self.nodes.values()))

    def status_of(self, trainer_id: str) -> TrainerStatus | None:
        slot = self.slots.get(trainer_id)
        return slot.status if slot is not None else None

    def node_of(self, trainer_id: str) -> str | None:
        slot = self.slots.get(trainer_id)
        return slot.node if slot is not None else None

    def handle_of(self, trainer_id: str) -> Any:
        """The trainer's actor handle (None: no such trainer, or retired)."""
        slot = self.slots.get(trainer_id)
        return slot.handle if slot is not None and not slot.retired else None

    def single_device(self, trainer_id: str) -> bool:
        """Whether the trainer runs on one device (not a pipeline of stages): where interactive models go."""
        slot = self.slots.get(trainer_id)
        return slot is not None and slot.config.stages == 1

    def why_none_runs(self) -> str | None:
        """Why no trainer can take a job, when every one failed to start (and none is ready), or the cluster's nodes
        are not read yet; else None."""
        if not self.nodes_read:
            return READING_NODES
        return why_none_runs(list(self.slots.values()), self.kinds, list(self.nodes.values()))

    def note_phase(self, trainer_id: str, phase: str) -> None:
        """A trainer's set-up began `phase` (it tells the scheduler, which passes it on here)."""
        slot = self.slots.get(trainer_id)
        if slot is not None and slot.status is None:
            slot.phase, slot.placement.unplaced = phase, None   # it runs: placed

    def describe(self) -> list[dict[str, Any]]:
        """Each trainer as the service's `trainers()` reports it."""
        return [self._describe(slot) for slot in self.slots.values()]

    def _describe(self, slot: TrainerSlot) -> dict[str, Any]:
        node = self.nodes.get(slot.node or "")
        unplaced = slot.placement.unplaced
        info: dict[str, Any] = {"id": slot.trainer_id, "base_model": slot.config.base_model,
                                "quantization": slot.config.quantization, "error": slot.error,
                                "restarts": slot.restarts, "ready": slot.status is not None,
                                "actor_name": slot.actor_name, "node_id": slot.node,
                                "node_address": node.address if node else None, "threads": slot.threads,
                                "retired": slot.retired, "stages": slot.config.stages,
                                "stage_split": slot.config.stage_split,
                                "unplaceable": unplaced is not None and unplaced.settled,
                                "phase": "retired" if slot.retired else "ready" if slot.status is not None
                                else (slot.error and "failed") or (unplaced and unplaced.reason)
                                or slot.phase or "starting its process"}
        if slot.status is not None:
            status = asdict(slot.status)
            status.pop("linear_shapes")
            status.pop("expert_shapes", None)
            info.update(status)
            view = trainer_view(slot.status)
            info.update(memory_fixed_bytes=view.base_bytes, memory_step_bytes=view.step_memory_bytes)
        return info

    # -- what the scheduler has them do -----------------------------------------------------------------
    def assign(self, trainer_id: str, assignments: list[Assignment]) -> None:
        slot = self.slots.get(trainer_id)
        if slot is None or slot.retired:
            return   # its jobs were queued again when it was retired
        self.handles.assign(slot.handle, assignments)

    def stop_job(self, trainer_id: str, job: str, kind: str, reason: str) -> None:
        """Ask the trainer to end `job` at its next step boundary as `kind` (cancelled / paused)."""
        slot = self.slots.get(trainer_id)
        if slot is None or slot.handle is None:
            raise ValueError(f"job {job} is on trainer {trainer_id}, which this service does not have")
        self.handles.stop_job(slot.handle, job, kind, reason)

    def generate(self, trainer_id: str, job: str, prompt: str, max_new_tokens: int,
                 ticket: str | None = None) -> TrainerCall:
        """Ask the trainer holding `job` to continue `prompt` by its adapter and by the base alone; `ticket`: from
        `tries`, closed by the caller once it stops waiting."""
        slot = self.slots.get(trainer_id)
        if slot is None or slot.handle is None or slot.status is None or slot.retired:
            raise ValueError(f"job {job} is on trainer {trainer_id}, which is not ready now; try again in a moment")
        return self.handles.generate(slot.handle, job, prompt, max_new_tokens, ticket)

    def try_saved(self, job: str, spec: JobSpec, base: tuple[str, str], location: str, step: int, prompt: str,
                  max_new_tokens: int, ticket: str | None = None) -> TrainerCall:
        """Ask a ready trainer holding the job's `base` (its base model and quantization) to continue `prompt` by
        the adapter a finished job saved at `location`, between two of its steps: a single-device one where there is
        one (the least loaded), else a pipeline (its stages each hold their share for the call). ValueError where
        none holds it."""
        base_model = base[0]
        ready = [s for s in self.ready_statuses() if (s.base_model, s.quantization) == base]
        if not ready:
            raise ValueError(f"no trainer holds job {job}'s base model {base_model} now: its adapter can be tried on "
                             "one that does (`aspen trainers`), or exported (`aspen export`) and loaded with PEFT")
        chosen = min(ready, key=lambda status: (not self.single_device(status.trainer_id), len(status.jobs),
                                                status.trainer_id))
        return self.handles.try_saved(self.slots[chosen.trainer_id].handle, job, spec, location, step, prompt,
                                      max_new_tokens, ticket)

    def shutdown(self, timeout_s: float = 180.0) -> list[tuple[str, list[TrainerEvent]]]:
        """Stop the ready trainers (their running jobs pause with a checkpoint); each one's last events."""
        calls = {tid: self.handles.shutdown(s.handle) for tid, s in self.slots.items()
                 if s.status is not None and not s.retired}
        answers = []
        deadline = time.monotonic() + timeout_s   # for all of them: they stop at the same time
        for trainer_id, call in calls.items():
            events: list[TrainerEvent] = []
            polling = self.slots[trainer_id].poll
            if polling is not None:   # a poll in flight answers first (the actor takes calls in order): its
                try:                  # events (a step's progress) would be lost with it
                    events.extend(polling.result(timeout=max(deadline - time.monotonic(), 1.0))[1])
                except TrainerCallFailed as error:
                    log.warning("scheduler: trainer %s: its last poll failed at shutdown: %s", trainer_id, error)
                self.slots[trainer_id].poll = None
            try:
                events.extend(call.result(timeout=max(deadline - time.monotonic(), 1.0)))
            except TrainerCallFailed as error:
                log.warning("scheduler: trainer %s did not shut down cleanly: %s", trainer_id, error)
                if not events:
                    continue
            answers.append((trainer_id, events))
        return answers

    def kill_all(self) -> None:
        for slot in self.slots.values():
            if slot.handle is not None:
                self._kill(slot, "stopping")

    # -- supervision, every tick -------------------------------------------------------------------------
    def follow_if_due(self) -> None:
        if self.nodes_seen_at is None or self.clock() - self.nodes_seen_at >= self.cluster_poll_s:
            nodes = self.handles.nodes()
            if nodes is not None:   # None: the first read has not answered; looked at again next tick
                self.follow(nodes)

    def watch_all(self) -> None:
        for slot in list(self.slots.values()):
            self._watch(slot)

    def drop_retired(self) -> list[str]:
        """Forget the retired trainers whose last events are in the table; their ids."""
        dropped = [s.trainer_id for s in self.slots.values() if s.retired and not self.intake.waiting(s.trainer_id)]
        for trainer_id in dropped:
            del self.slots[trainer_id]
        return dropped

    def follow(self, nodes: list[NodeInfo]) -> None:
        """Start the planned trainers that are not running, move `any` trainers off nodes that left, retire
        the trainers of nodes that left (their jobs resume elsewhere)."""
        first, self.nodes_seen_at = not self.nodes_read, self.clock()
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
                slot = TrainerSlot(trainer_id=f"trainer-{self.next_trainer}", config=planned.config,
                                   threads=planned.threads, key=planned.key, node=planned.node,
                                   ram_share=planned.ram_share)
                self.next_trainer += 1
                self.slots[slot.trainer_id] = slot
                self._launch(slot)
                log.info("scheduler: %s starts on node %s (%s threads)", slot.trainer_id, short_node(slot.node),
                         slot.threads or "default")
            elif slot.node != planned.node:   # an `any` trainer whose node left: started on a live one
                lost_node = slot.node
                slot.node, slot.threads, slot.ram_share = planned.node, planned.threads, planned.ram_share
                self._replace(slot, f"its node {short_node(lost_node)} left the cluster")
        for slot in running.values():      # planned no more: its node left
            self._retire(slot, f"its node {short_node(slot.node)} left the cluster")
        if first and not self.slots:
            log.warning("scheduler: no node of the cluster has the resources of a trainer (%s); jobs wait until one "
                        "joins", ", ".join(f"{n.address}: {n.cpus:g} CPU, {n.gpus:g} GPU" for n in nodes))

    def _watch(self, slot: TrainerSlot) -> None:
        if slot.error or slot.retired:
            return
        if slot.status is None:
            if not slot.ready.done():
                self._look_at_placement(slot)
                return
            try:
                slot.status = slot.ready.result()
                log.info("scheduler: %s ready (%s)", slot.trainer_id, slot.status.base_model)
            except TrainerCallFailed as error:
                if self._node_left(slot):
                    return
                slot.error = f"could not start: {error.cause}"
                log.error("scheduler: trainer %s %s", slot.trainer_id, slot.error)
            return
        if slot.poll is None:
            slot.poll, slot.poll_sent = self.handles.poll(slot.handle), self.clock()
            return
        if not slot.poll.done():
            if self.clock() - slot.poll_sent > self.trainer_timeout_s:
                self._replace(slot, f"no answer for {self.trainer_timeout_s:.0f}s")
            return
        try:
            status, events = slot.poll.result()
        except TrainerUnavailable as error:
            # its node may be dying (Ray has not declared it dead yet) or the network hiccupped: ask again
            # until the node is known lost (the trainer is retired) or UNAVAILABLE_GRACE_S have passed
            slot.poll = None
            slot.unavailable_since = slot.unavailable_since or self.clock()
            if self._node_left(slot):
                return
            if self.clock() - slot.unavailable_since > UNAVAILABLE_GRACE_S:
                self._replace(slot, f"{error.kind} for {UNAVAILABLE_GRACE_S:.0f}s")
            return
        except TrainerCallFailed as error:
            self._replace(slot, error.kind)
            return
        slot.poll, slot.unavailable_since = None, 0.0
        slot.status = status
        self.intake.put(slot.trainer_id, events)   # into the job table by the intake, retried while it is locked
        if not events:
            self.on_polled(status)

    def _look_at_placement(self, slot: TrainerSlot) -> None:
        """A trainer unstarted a while: whether any live node could hold it (fleet_placement.py); where the
        autoscaler says none ever can, it fails."""
        if slot.phase:   # started: placed
            return
        final = slot.placement.look(slot.trainer_id, slot.config, list(self.nodes.values()), self.handles.autoscaling,
                                    self.cluster_poll_s, self.clock())
        if final is not None:
            slot.error = final
            self._kill(slot, "unplaceable")

    def _replace(self, slot: TrainerSlot, why: str) -> None:
        """Start a new trainer; its predecessor's jobs are queued again once everything it reported before
        it died is in the table (so that a job it finished is not run again). A trainer whose node left the
        cluster is retired instead (or, of an `any` kind, started on a live node)."""
        if not why.startswith("its node") and self._node_left(slot):
            return
        log.warning("scheduler: trainer %s lost (%s); starting a new one", slot.trainer_id, why)
        self.intake.put(slot.trainer_id, [TrainerLost(why=why)])
        self._kill(slot, "lost")
        slot.restarts += 1
        slot.unavailable_since = 0.0
        self._launch(slot)

    def _retire(self, slot: TrainerSlot, why: str) -> None:
        log.warning("scheduler: trainer %s retired (%s); its jobs resume on other trainers", slot.trainer_id, why)
        self.intake.put(slot.trainer_id, [TrainerLost(why=why)])
        slot.retired, slot.status, slot.poll, slot.ready = True, None, None, None
        self._kill(slot, "retired")

    def _kill(self, slot: TrainerSlot, what: str) -> None:
        try:
            self.handles.kill(slot.handle)
        except TrainerCallFailed as error:
            log.info("scheduler: killing %s trainer %s: %s", what, slot.trainer_id, error)

    def _node_left(self, slot: TrainerSlot) -> bool:
        """Whether the slot's node has left the cluster (looked up now); if so the trainers follow."""
        if slot.node is None:
            return False
        nodes = self.handles.nodes(fresh=True)   # a trainer's call failed: rare, and the last read may be stale
        if any(node.id == slot.node for node in nodes):
            return False
        self.follow(nodes)
        return True

    def _launch(self, slot: TrainerSlot) -> None:
        slot.handle, slot.actor_name = self.handles.launch(slot.trainer_id, slot.restarts, slot.config, slot.node,
                                                           slot.threads, slot.ram_share)
        slot.ready = self.handles.start(slot.handle)
        slot.poll, slot.status, slot.error, slot.phase = None, None, None, ""
        slot.placement.launched(self.clock())
