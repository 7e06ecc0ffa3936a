"""`TrainerActor`: one per GPU, or a configured number on CPU (`GpuTrainerActor` is its old name, kept as an
alias). It loads its base model once and runs
fused steps continuously over the jobs assigned to it.

The actor takes one call at a time, and drives itself: each `tick` runs one fused step and queues the
next `tick` behind whatever calls (assign, stop, poll) arrived meanwhile, so those take effect at the
next step boundary (an idle tick waits a little first: 50 ms while there is work, 0.5 s after a quiet spell,
actors/service/trainer/idle_pace.py). The steps thus run on the actor's main thread: on CPU, torch runs the same step
markedly slower from a side thread (measured 10-20% on 2 cores)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError

from actors.niceness import normal_priority
from actors.service.scheduler.call_waits import TICKET_ASK_S, TICKET_WATCH_S, Withdrawn
from actors.service.scheduler.cluster_plan import host_memory
from actors.service.scheduler.config import StorageConfig, TrainerConfig
from actors.service.trainer.idle_pace import IdlePace
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from actors.spec.typed_args import expect_type
from actors.storage.s3_settings import configure_storage

if TYPE_CHECKING:   # the engine (torch) is imported in the trainer's own process only
    from actors.service.trainer.interactive_desk import InteractiveDesk, Outcome

log = logging.getLogger(__name__)


class SchedulerLink:
    """A trainer's questions and notes to its scheduler, by name. Called, it tells the scheduler (without waiting
    for an answer) each phase of the trainer's set-up, and logs it too; `refuse_withdrawn` asks whether a "try it"
    is still waited for. A scheduler that cannot be found is logged once and not asked again: the phases are a
    courtesy, and a trainer without its scheduler (a test's own) runs every call it is sent."""

    def __init__(self, scheduler: str | None, trainer_id: str):
        self.scheduler, self.trainer_id = scheduler, trainer_id
        self.handle = None

    def _found(self) -> bool:
        if self.scheduler is None:
            return False
        try:
            if self.handle is None:
                from actors.service.scheduler.config import NAMESPACE
                self.handle = ray.get_actor(self.scheduler, namespace=NAMESPACE)
            return True
        except ValueError as error:   # no such actor (a test's own trainer, or the scheduler is gone)
            log.warning("trainer %s: cannot reach the scheduler %s (%s); not trying again", self.trainer_id,
                        self.scheduler, error)
            self.scheduler = None
            return False

    def __call__(self, phase: str) -> None:
        log.info("trainer %s: %s", self.trainer_id, phase)
        if self._found():
            self.handle.trainer_phase.remote(self.trainer_id, phase)

    def refuse_withdrawn(self, ticket: str | None) -> None:
        """Raise `Withdrawn` where the scheduler no longer waits for the "try it" of `ticket` (it gave up while the
        call queued here), so that it takes none of this trainer's time; a scheduler that does not answer within
        TICKET_ASK_S is logged, and the call run."""
        if ticket is None or not self._found():
            return
        try:
            waited = ray.get(self.handle.try_waited.remote(ticket), timeout=TICKET_ASK_S)
        except RayError as error:
            log.warning("trainer %s: the scheduler did not say whether a \"try it\" is still waited for (%s); "
                        "running it", self.trainer_id, error)
            return
        if not waited:
            log.info("trainer %s: a \"try it\" the scheduler gave up waiting for is dropped unrun", self.trainer_id)
            raise Withdrawn("the service stopped waiting for this \"try it\" while it queued on the trainer, "
                            "which dropped it unrun; send it again")

    def watch(self, ticket: str | None) -> TicketWatch | None:
        """While the "try it" of `ticket` runs: whether the scheduler still waits for it (None: nobody to ask)."""
        return TicketWatch(self.handle, ticket) if ticket is not None and self._found() else None


class TicketWatch:
    """Whether the "try it" of `ticket`, generating here, was withdrawn (called between decode steps): the scheduler
    is asked at most every TICKET_WATCH_S and its answer taken when it has come, the decoding never waiting for it
    (not one call per token). Once withdrawn, it stays so; a question that failed is logged, and asked again."""

    def __init__(self, scheduler: Any, ticket: str):
        self.scheduler, self.ticket = scheduler, ticket
        self.asked: Any = None   # the question in flight
        self.last = time.monotonic()
        self.gone = False

    def __call__(self) -> bool:
        if self.gone:
            return True
        if self.asked is None:
            if time.monotonic() - self.last >= TICKET_WATCH_S:
                self.asked = self.scheduler.try_waited.remote(self.ticket)
            return False
        if not ray.wait([self.asked], timeout=0)[0]:
            return False
        try:
            self.gone = not ray.get(self.asked)
        except RayError as error:
            log.warning("the scheduler did not say whether a \"try it\" is still waited for (%s); generating on", error)
        self.asked, self.last = None, time.monotonic()
        return self.gone


@ray.remote(max_restarts=0)
class TrainerActor:
    def __init__(self, trainer_id: str, config: TrainerConfig, state_dir: str, threads: int | None = None,
                 policy: str | None = None, storage: StorageConfig | None = None, scheduler: str | None = None,
                 ram_share: float = 1.0):
        """`policy`: the service's policy; where it composes steps (`compose_step`, e.g. minpad), the
        trainer loads it and lets it choose which jobs share each step. `storage`: the service's
        `storage:` settings: how its jobs' storage URIs are reached. `scheduler`: the
        scheduler actor's name, told each phase of the set-up as it begins (`aspen run` shows them).
        `ram_share`: a CPU trainer's share of its node's RAM for its default memory budget (cluster_plan.py)."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        if storage is not None:
            configure_storage(storage.settings())
        normal_priority()
        # imported here, in the trainer's own process: torch, transformers and the engine take seconds to
        # import, and the scheduler that creates trainers imports this module without needing them
        from actors.service.trainer.trainer_setup import start_trainer_loop

        self.schedule = SchedulerLink(scheduler, trainer_id)
        stages = None
        if config.stages > 1:   # the other stages: actors in a placement group of their own
            from actors.stage_actors import RayStageStarter, node_address
            name = ray.get_runtime_context().get_actor_name() or trainer_id
            starter = RayStageStarter(name, config.stages, num_cpus=config.num_cpus, num_gpus=config.num_gpus,
                                      strategy=config.stage_placement.upper(), memory=host_memory(config))
            stages = {"starter": starter, "address": node_address(), "on_close": starter.close}
        try:
            self.loop = start_trainer_loop(trainer_id, config, Path(state_dir), threads=threads, policy=policy,
                                           stages=stages, on_phase=self.schedule,
                                           ram_share=ram_share)
        except BaseException:
            if stages is not None:
                stages["on_close"]()   # the stages' placement group
            raise
        self.stopping = False
        self.started = False
        self.pace = IdlePace()   # an idle tick's wait: short while there is work, longer after a quiet spell
        self.loop.collection.take_over()   # this process is the trainer's: its full collections between kernels

    def start(self) -> TrainerStatus:
        """Start stepping (idempotent); returns the trainer's status."""
        if not self.started:
            self.started = True
            ray.get_runtime_context().current_actor.tick.remote()
        return self.loop.status()

    def tick(self) -> None:
        """One fused step (or a short idle wait), then the next tick goes to the back of the queue."""
        if self.stopping:
            return
        try:
            self.loop.run_once(idle_wait=self.pace.next_wait(self.loop.has_work()))
        except Exception:  # a step's own errors are handled inside; this is a bug, logged
            log.exception("trainer %s: unexpected error in a step", self.loop.trainer_id)
        ray.get_runtime_context().current_actor.tick.remote()

    def status(self) -> TrainerStatus:
        return self.loop.status()

    def poll(self) -> tuple[TrainerStatus, list[TrainerEvent]]:
        return self.loop.status(), self.loop.drain_events()

    def assign(self, assignments: list[Assignment]) -> None:
        """Jobs to start, all at the same step boundary, each with its link to its JobActor."""
        self.loop.assign([expect_type(a, Assignment, "an assignment") for a in assignments])

    def stop_job(self, job_id: str, kind: str, reason: str) -> None:
        self.loop.stop_job(job_id, kind, reason)

    def generate(self, job_id: str, prompt: str, max_new_tokens: int, ticket: str | None = None) -> dict:
        """`prompt` continued by the job's current adapter and by the base alone, between two steps (this actor
        takes one call at a time): actors/service/trainer/try_adapter.py. `ticket`: the scheduler's for the call,
        which is run only while the scheduler still waits for it (`Withdrawn` where not), and stopped between two
        decode steps once it no longer does (`TicketWatch`): the trainer goes back to its steps."""
        self.schedule.refuse_withdrawn(ticket)
        return self.loop.try_prompt(job_id, prompt, max_new_tokens, self.schedule.watch(ticket))

    def try_saved(self, job_id: str, spec: Any, location: str, step: int, prompt: str, max_new_tokens: int,
                  ticket: str | None = None) -> dict:
        """As `generate`, through the adapter a finished job saved at `location` (held for the call only)."""
        self.schedule.refuse_withdrawn(ticket)
        return self.loop.try_saved(job_id, spec, location, step, prompt, max_new_tokens, self.schedule.watch(ticket))

    # -- interactive models (the Tinker API's): actors/service/trainer/interactive_desk.py --------------------
    # Each call returns at once (the steps run on this actor's one thread): a model's call is queued and its
    # outcome taken later by the front that sent it (`tinker_take`).
    def _desk(self) -> InteractiveDesk:
        if self.loop.desk is None:
            raise ValueError(f"trainer {self.loop.trainer_id} runs a pipeline over several stages, which holds no "
                             "interactive models")
        return self.loop.desk

    def tinker_open(self, job_id: str, model_id: str, rank: int, owner: str | None, seed: int = 0,
                    train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1, output_dir: str | None = None,
                    base_name: str = "", resume: bool = False, train_unembed: bool = False) -> int | None:
        return self._desk().open(job_id, model_id, rank, owner=owner, seed=seed, train_attn=train_attn,
                                 train_mlp=train_mlp, first_seq=first_seq, output_dir=output_dir, base_name=base_name,
                                 resume=resume, train_unembed=train_unembed)

    def tinker_submit(self, front: str, model_id: str, seq_id: int, kind: str, payload: Any) -> str:
        return self._desk().submit(front, model_id, seq_id, kind, payload)

    def tinker_sample(self, front: str, call: Any) -> str:
        return self._desk().sample(front, call)

    def tinker_take(self, front: str) -> list[Outcome]:
        return self._desk().take(front)

    def tinker_finish(self, front: str, model_id: str, last: Any) -> str:
        return self._desk().finish(front, model_id, last)

    def tinker_beat(self, model_ids: list[str]) -> list[str]:
        return self._desk().beat(model_ids)

    def tinker_close(self, model_id: str) -> str | None:
        return self._desk().close(model_id)

    def tinker_close_job(self, job_id: str) -> list[str]:
        return self._desk().close_job(job_id)

    def tinker_drop_adapter(self, name: str) -> None:
        self._desk().drop_adapter(name)

    def tinker_cancel(self, key: str) -> bool:
        return self._desk().cancel(key)

    def tinker_hold_sampler(self, front: str, name: str, folder: str) -> str:
        return self._desk().hold_sampler(front, name, folder)

    def tinker_facts(self) -> dict[str, Any]:
        return self._desk().facts()

    def shutdown(self) -> list[TrainerEvent]:
        """Stop stepping; jobs still here are paused with a checkpoint. Returns the last events."""
        self.stopping = True
        self.loop.close()
        return self.loop.drain_events()


GpuTrainerActor = TrainerActor   # the name of earlier releases: it runs on CPU as well
