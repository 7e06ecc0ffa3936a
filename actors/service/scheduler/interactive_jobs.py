"""Interactive models (the Tinker API's) as jobs of the service: a model is entered in the job table as a job of
method `interactive`, owned by its user, running on a single-device trainer that holds its base and has the
memory for its adapter and AdamW state beside what it holds already (the same estimate as any job's). It counts
in admission (its memory is held on that trainer), in fair share and the accounts (its tokens are booked from
the trainer's step events like any job's), and is shown by the console and the metrics. It is never placed by
the policy: it starts when its user creates it, runs on the trainer it was opened on, and ends when its session
ends (completed), when it is cancelled, or when its trainer or the service goes (failed; its last saved state
stays where it was written).

It is a running job as a policy's `Admission` counts one (policies/base.py): it takes one of its trainer's
`max_jobs`, one of its node's job slots (`job_processes_per_node`) and one of its user's `max_running`. A model
was once opened on memory alone, on a trainer already running its `max_jobs` (the operator's limit exceeded); it
is now refused while none of them has room (`NoRoom`, `OverQuota`: the SDK's create is answered 503 / 429 and
retried), and at once where it never could be (a `max_running` of 0, the day's tokens used up: ValueError)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.engine.lora_targets import stack_targets
from actors.service.scheduler.job_fit import job_adapter_bytes, never_fits, trainer_view
from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.table.job_record import JobRecord
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerStatus
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.lora_config import LoraConfig
from actors.spec.model_parts import HEAD_MODULE, part_targets
from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER
from policies.base import UserShare, memory_in_use

TINKER_REMEDY = ("create it with a lower rank or fewer trained parts (train_mlp=False, train_unembed=False), or "
                 "have an operator give a trainer of its base a larger memory_budget_bytes or a smaller step_tokens")
LORA_ALPHA = 32.0    # the Tinker API's adapters: alpha 32 at every rank (actors/engine/interactive_model.py)


class NoRoom(RuntimeError):
    """No trainer can hold the model now (a retryable refusal: the user may try again later)."""


class OverQuota(NoRoom):
    """The user runs their `max_running` jobs (retryable: once one of them ends, the model can be created)."""


# where each trainer runs and each node's job slots (SchedulerCore.node_of, .job_slots): none, no node limit
Hosts = Callable[[], tuple[Callable[[str], "str | None"], dict[str, int]]]


@dataclass(frozen=True)
class Opened:
    record: JobRecord
    trainer: str


TINKER_FOLDER = "tinker"   # under the state folder: each model's saves, and its final adapter


def model_folder(weights_dir: Path, model_id: str) -> Path:
    """A model's folder: its final adapter (what `aspen export` exports), `weights/<name>` (its saved states)
    and `sampler_weights/<name>`."""
    return weights_dir / model_id.replace(":", "-")


def job_name(model_id: str) -> str:
    """A job name for a model id (`<session>:train:<n>`): the name pattern's characters only."""
    return "tinker-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def interactive_submission(model_id: str, base_model: str, rank: int, targets: list[str],
                           user: str | None, stacks: list[str] | None = None) -> JobSubmission:
    """`stacks`: the MoE base's expert stacks, where the model trains the MLP (as the trainer's
    `interactive_model.interactive_lora` adapts them)."""
    lora = LoraConfig(r=rank, alpha=LORA_ALPHA, dropout=0.0, target_modules=targets, target_parameters=stacks or [])
    job = JobSpec(name=job_name(model_id), method="interactive", lora=lora, lr_schedule="constant", max_steps=None,
                  epochs=None, checkpoint_every_s=None)
    return JobSubmission(job=job, base_model=base_model, user=user)


class InteractiveJobs:
    """Entering and ending interactive models' jobs in the job table (called under the scheduler's lock)."""

    def __init__(self, table: JobTable, state_dir: Path, scheduling: SchedulingStates,
                 hosts: Hosts = lambda: (lambda trainer_id: None, {})):
        """`scheduling`: the scheduler's memory of each job, whose memory estimate is set here for a model's job
        so that admission counts it; `hosts`: each trainer's node and each node's job slots, as they are now."""
        self.table = table
        self.state_dir = state_dir
        self.scheduling = scheduling
        self.hosts = hosts

    def _memory(self, job_id: str) -> int:
        state = self.scheduling.get(job_id)
        return (state.memory or 0) if state is not None else 0

    def open(self, model_id: str, base_model: str, rank: int, user: str | None, candidates: list[TrainerStatus], *,
             train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = False,
             standing: UserShare | None = None) -> Opened:
        """Enter the model's job, running on the candidate trainer holding `base_model` with a free job slot and
        the most memory left. ValueError: no trainer holds that base, or the model is too large for each even
        alone, or the user's quotas never let it run now (`standing`: the day's tokens used up, a `max_running` of
        0); OverQuota: the user runs their `max_running`
        jobs; NoRoom: no trainer has a free slot and the memory now. The SDK's retry of a create that was carried
        out is answered with the model as it runs (it holds its slot already)."""
        existing = self._existing(job_name(model_id))
        if existing is not None and existing.state == "running":
            return Opened(existing, existing.trainer or "")
        same_base = [s for s in candidates if s.base_model == base_model]
        if not same_base:
            held = sorted({s.base_model for s in candidates}) or ["none ready"]
            raise ValueError(f"base model '{base_model}' is not held by a trainer that takes interactive models "
                             f"(held: {', '.join(held)})")
        if not (train_attn or train_mlp or train_unembed):
            raise ValueError("train_attn, train_mlp and train_unembed are all false: nothing to train")
        targets = part_targets(list(same_base[0].linear_shapes), train_attn=train_attn, train_mlp=train_mlp)
        stacks = stack_targets(same_base[0].expert_shapes) if train_mlp else []
        if not targets and not stacks and not train_unembed:
            raise ValueError("train_mlp alone, but nothing of this base's MLP is adapted (on some MoE types its dense "
                             "and shared MLP layers are left alone: docs/models.md): train attention too "
                             "(train_attn=True)")
        # the LM head as PEFT lists it (`train_unembed`): its adapter counted by the trainer's head shape (`_place`)
        targets = [*targets, HEAD_MODULE] if train_unembed else targets
        submission = interactive_submission(model_id, base_model, rank, targets, user, stacks)
        self._check_fits(submission, same_base)   # never: told at once, before a quota that frees in time
        self._check_quota(user, standing)
        best, need = self._place(submission, same_base)
        job_id = submission.job.name
        if existing is not None and not existing.finished:
            return Opened(existing, existing.trainer or best.trainer_id)   # the SDK's retry of the same create
        if existing is not None:
            self.table.delete(job_id)
        output = model_folder(self.state_dir / TINKER_FOLDER, model_id)
        self.table.add(job_id, submission, output)
        record = self.table.set_state(job_id, "running", f"an interactive model of {user or 'an operator'} on "
                                      f"{best.trainer_id}", trainer=best.trainer_id)
        self.table.after_commit(lambda: setattr(self.scheduling.of(job_id), "memory", need))
        return Opened(record, best.trainer_id)

    def _existing(self, job_id: str) -> JobRecord | None:
        try:
            return self.table.get(job_id)
        except KeyError:
            return None

    def _check_quota(self, user: str | None, standing: UserShare | None) -> None:
        """The user's quotas as a policy's `Admission.quota_reason` keeps them, a model counting as a running job."""
        if standing is None:
            return
        if standing.out_of_tokens:
            raise ValueError(f"user {user} has trained their {standing.tokens_per_day} tokens of the last 24 hours "
                             "(tokens_per_day); a model can be created once their usage falls below it")
        if standing.max_running is None:
            return
        if standing.max_running == 0:
            raise ValueError(f"user {user}'s max_running quota is 0: none of their jobs may run, an interactive "
                             f"model neither; ask an admin to raise it (aspen user set {user} --quota running=N)")
        running = sorted(r.name for r in self.table.all(("running",)) if r.user == user)
        if len(running) >= standing.max_running:
            shown = ", ".join(running[:3]) + (f" and {len(running) - 3} more" if len(running) > 3 else "")
            raise OverQuota(f"user {user} runs {len(running)} jobs ({shown}), their max_running quota "
                            f"({standing.max_running}; an interactive model counts as one); a model can be created "
                            f"once one of them ends, or an admin raises it (aspen user set {user} --quota "
                            "running=N)")

    def _place(self, submission: JobSubmission, same_base: list[TrainerStatus]) -> tuple[TrainerStatus, int]:
        """The trainer with a free job slot (its `max_jobs`, its node's job slots) and the most memory left once
        the model's adapter and optimizer state are on it, and what those need; NoRoom where none has the room
        now, saying each trainer's want; ValueError where none could hold it even alone (`never_fits`)."""
        if not same_base:   # a lost trainer's successor still loading (`reopen`)
            raise NoRoom(f"no ready trainer holds {submission.base_model} now (one may be starting again); try again")
        best, best_free = None, None
        need = self._check_fits(submission, same_base)
        held_by, on_node = self._taken()
        node_of, slots = self.hosts()
        wants: dict[str, list[str]] = {"max_jobs": [], "slots": [], "memory": []}
        for status in same_base:
            view, node = trainer_view(status), node_of(status.trainer_id)
            here = set(status.jobs) | held_by.get(status.trainer_id, set())
            if status.max_jobs is not None and len(here) >= status.max_jobs:
                wants["max_jobs"].append(f"{status.trainer_id} runs {len(here)} jobs, its max_jobs "
                                         f"({status.max_jobs})")
                continue
            if node in slots and on_node.get(node, 0) >= slots[node]:
                wants["slots"].append(f"{status.trainer_id}'s node {node[:12]} runs {on_node[node]} jobs, its job "
                                      f"slots (job_processes_per_node: {slots[node]})")
                continue
            held = memory_in_use(view, []) + sum(self._memory(job_id) for job_id in here)
            free = view.memory_budget_bytes - held - need
            if free < 0:
                wants["memory"].append(f"{status.trainer_id} has {max(free + need, 0) / 2**20:.1f} MiB of its memory "
                                       f"budget free, the model needs {need / 2**20:.1f} MiB with its optimizer "
                                       "state")
            elif best_free is None or free > best_free:
                best, best_free = status, free
        if best is None:
            raise NoRoom(no_room_message(submission, wants))
        return best, need

    def _check_fits(self, submission: JobSubmission, same_base: list[TrainerStatus]) -> int:
        """What the model needs (`_need`); ValueError where that exceeds every trainer's budget beside its base even
        alone (`never_fits`, as a batch job's: it was once refused for now, and retried by the SDK ~5 minutes)."""
        need = self._need(submission, same_base[0])   # one base: the same shapes on each
        problem = never_fits(submission, need, [trainer_view(s) for s in same_base], rank="rank",
                             remedy=TINKER_REMEDY)
        if problem:
            raise ValueError(f"model of {submission.base_model} cannot run on any trainer: {problem}")
        return need

    @staticmethod
    def _need(submission: JobSubmission, status: TrainerStatus) -> int:
        """The model's adapter and AdamW state on `status`'s base (its LM head's by the trainer's head shape)."""
        lora = submission.job.lora
        layers = lora.model_copy(update={"target_modules": [t for t in lora.target_modules if t != HEAD_MODULE]})
        need = job_adapter_bytes(layers, trainer_view(status)) if layers.target_modules or layers.target_parameters \
            else 0
        # LoRA on the LM head: r x (its inputs + outputs) parameters
        return need + (BYTES_PER_ADAPTER_PARAMETER * lora.r * sum(status.head_shape)
                       if HEAD_MODULE in lora.target_modules else 0)

    def _taken(self) -> tuple[dict[str | None, set[str]], dict[str, int]]:
        """The jobs each trainer holds by the table and the scheduler, and the running jobs on each node (those
        with job slots count), as a policy's `Admission` counts them: the jobs running there (one a round started
        there that its trainer does not report yet, its job actor still starting, was once not counted, and the
        model placed past the budget), and those moving there (a move in flight, pausing on their old trainer or
        paused and started there by the next round, moved_jobs.py: once not counted, the model took their room
        and the moved job went back to the policy, a wasted move)."""
        held_by: dict[str | None, set[str]] = {}
        for record in self.table.all(("running",)):
            held_by.setdefault(record.trainer, set()).add(record.id)
        for job_id, state in list(self.scheduling.items()):
            record = self._existing(job_id) if state.moving_to is not None else None
            if record is not None and (record.state == "queued" or (record.state == "running"
                                                                     and record.trainer != state.moving_to)):
                held_by.setdefault(state.moving_to, set()).add(job_id)
        node_of, slots = self.hosts()
        on_node: dict[str, int] = {}
        for trainer_id, jobs in held_by.items():
            node = node_of(trainer_id) if trainer_id else None
            if node in slots:
                on_node[node] = on_node.get(node, 0) + len(jobs)
        return held_by, on_node

    def reopen(self, job_id: str, lost_trainer: str, candidates: list[TrainerStatus],
               standing: UserShare | None = None) -> Opened:
        """Place a model whose trainer was lost again (its front resumes it there from its checkpoint), its
        user's quotas checked again as a create's (`standing`): a job of theirs may have started meanwhile.
        KeyError: its job has ended; NoRoom: the loss is not booked yet, or no trainer has the room now, or the
        user runs their `max_running` jobs (the front tries again, as the SDK does a create); ValueError: their
        quotas never let it run now."""
        record = self.table.get(job_id)
        if record.finished:
            raise KeyError(f"job {job_id} has ended ({record.state}: {record.reason})")
        if record.state == "running":
            if record.trainer != lost_trainer:
                return Opened(record, record.trainer or "")   # placed again already (a retried call)
            raise NoRoom(f"the loss of trainer {lost_trainer} is not booked yet; try again")
        try:
            self._check_quota(record.user, standing)
        except OverQuota as over:   # not a 429: its front tries a 503 again (orchestrator/tinker/remote_calls.py)
            raise NoRoom(str(over)) from None
        submission = self.table.submission(job_id)
        best, need = self._place(submission, [s for s in candidates if s.base_model == submission.base_model])
        step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "its start"
        record = self.table.set_state(job_id, "running", f"an interactive model of {record.user or 'an operator'} "
                                      f"on {best.trainer_id}, resumed from {step}", trainer=best.trainer_id)
        self.table.after_commit(lambda: setattr(self.scheduling.of(job_id), "memory", need))
        return Opened(record, best.trainer_id)

    def waits(self, job_id: str, why: str) -> None:
        """Say on a lost trainer's model, while it waits to be placed again, why (`reopen`'s NoRoom)."""
        record = self._existing(job_id)
        if record is not None and record.state == "queued":
            self.table.set_reason(job_id, f"its trainer was lost; waiting to be placed again: {why}")

    def close(self, job_id: str, state: str, reason: str, adapter_dir: str | None = None) -> JobRecord:
        """End a model's job (`completed`: its session ended; `cancelled`, `failed`), keeping where its last
        saved state is (`adapter_dir`, what `aspen export` exports)."""
        record = self.table.get(job_id)
        if record.finished:
            return record
        columns = {"trainer": None}
        if adapter_dir is not None:
            columns["adapter_dir"] = adapter_dir
        return self.table.set_state(job_id, state, reason, **columns)


def no_room_message(submission: JobSubmission, wants: dict[str, list[str]]) -> str:
    """Why no trainer takes the model now (`wants`: each limit's trainers), and what frees or raises it."""
    remedies = {"max_jobs": "an operator raises the trainer's max_jobs (its settings in the service config)",
                "slots": "an operator raises job_processes_per_node (the service config)",
                "memory": "a lower rank (or train_unembed=False) needs less memory"}
    said = [want for wants_of in wants.values() for want in wants_of]
    how = "; ".join(remedies[limit] for limit, wants_of in wants.items() if wants_of)
    return (f"no ready trainer holding {submission.base_model} has room for a rank-{submission.job.lora.r} model "
            f"now ({'; '.join(said)}); try again when a job there ends, or {how}")


def is_interactive(submission: JobSubmission) -> bool:
    return submission.job.method == "interactive"
