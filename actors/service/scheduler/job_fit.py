"""Whether a job fits a trainer: the policies' view of a trainer (its weights and a full step), a job's
adapter bytes on it, and why a job could never run on any trainer."""

from __future__ import annotations

from actors.engine.lora_targets import adapted_shapes, matching_shapes
from actors.service.trainer.trainer_reports import TrainerStatus
from actors.spec.job_submission import JobSubmission
from actors.spec.lora_config import BASE_DEPENDENT_INITS, LoraConfig
from policies.adapter_memory import (
    BYTES_PER_ADAPTER_PARAMETER,
    BYTES_PER_FROZEN_VALUE,
    adapter_memory_bytes,
    expert_parameters,
)
from policies.base import TrainerView


def job_adapter_bytes(lora: LoraConfig, trainer: TrainerView, *, reference: bool = False,
                      keep_best: bool = False) -> int:
    """What a job's adapter costs on `trainer` (ValueError for target_modules its base does not have); `reference`:
    with the frozen copy that is its reference model (`JobSpec.reference_adapter`); `keep_best`: with the host copy
    of its best evaluation's adapter, on a trainer whose budget is the host's (actors/engine/kept_best.py)."""
    shapes = adapted_shapes(lora.target_modules, {name: (i, o) for name, i, o in trainer.linear_shapes})
    stacks = matching_shapes(lora.target_parameters, {name: (e, i, o) for name, e, i, o in trainer.expert_shapes})
    if lora.target_parameters and not stacks:
        raise ValueError(f"lora.target_parameters: {', '.join(lora.target_parameters)} names no expert stack of "
                         f"{trainer.base_model}" + (" (it is not an MoE model)" if not trainer.expert_shapes else
                                                    f"; its stacks are {_stack_names(trainer)}"))
    experts = expert_parameters(lora.r, stacks)
    best_copy = keep_best and trainer.host_budget
    return (adapter_memory_bytes(lora.r, shapes, dora=lora.use_dora,
                                 frozen_initial=lora.init_lora_weights.startswith(BASE_DEPENDENT_INITS),
                                 vera=lora.kind == "vera", frozen_copy=reference, best_copy=best_copy)
            + experts * (BYTES_PER_ADAPTER_PARAMETER + BYTES_PER_FROZEN_VALUE * (int(reference) + int(best_copy))))


def _stack_names(trainer: TrainerView) -> str:
    return ", ".join(sorted({".".join(name.split(".")[-2:]) for name, _, _, _ in trainer.expert_shapes}))


def trainer_view(status: TrainerStatus) -> TrainerView:
    """The trainer's fixed memory (its weights) and a full step's memory (its probe-measured estimate)."""
    shapes = tuple((name, i, o) for name, (i, o) in sorted(status.linear_shapes.items()))
    stacks = tuple((name, *shape) for name, shape in sorted(status.expert_shapes.items()))
    # Weights known exactly, and a full step by the trainer's estimate from its probe steps (measured by
    # the allocator at start). The fitted model is not used here: fitted while the same jobs are held,
    # its constant and per-token slope fold their adapters in, and the view (which adds each job's
    # adapter bytes itself) would count them twice and stay inflated after they leave. The trainer's
    # own per-step gate uses the fitted model, with the jobs as features of their own.
    rate = (status.tokens - status.padding_tokens) / status.busy_seconds if status.busy_seconds > 0 else None
    return TrainerView(id=status.trainer_id, base_model=status.base_model, quantization=status.quantization,
                       memory_budget_bytes=status.memory_budget_bytes, base_bytes=status.base_bytes,
                       step_memory_bytes=status.activation_bytes_estimate, jobs=tuple(status.jobs),
                       linear_shapes=shapes, max_jobs=status.max_jobs, expert_shapes=stacks,
                       empty_bytes=status.base_bytes + status.activation_bytes_estimate, tokens_per_s=rate or None,
                       host_budget=status.device == "cpu")


BATCH_REMEDY = ("lower lora.r or target fewer modules, or give the trainer a larger memory_budget_bytes or a smaller "
                "step_tokens")


def never_fits(submission: JobSubmission, need: int, views: list[TrainerView], *, rank: str = "lora.r",
               remedy: str = BATCH_REMEDY) -> str | None:
    """Why a job whose adapter needs `need` bytes exceeds the memory budget of every trainer that holds its
    base even alone, or None (`rank`, `remedy`: its rank's name and what to change, as its user says them)."""
    if any(v.base_bytes + v.step_memory_bytes + need <= v.memory_budget_bytes for v in views):
        return None
    if any(v.empty_bytes is not None and v.empty_bytes + need <= v.memory_budget_bytes for v in views):
        return None   # it fits a trainer once that trainer's jobs are gone: it waits
    best = max(views, key=lambda v: v.memory_budget_bytes - v.base_bytes - v.step_memory_bytes)
    left = best.memory_budget_bytes - best.base_bytes - best.step_memory_bytes
    return (f"its adapter ({rank}={submission.job.lora.r}) needs {need / 2**20:.0f} MiB but {best.id}'s memory "
            f"budget ({best.memory_budget_bytes / 2**20:.0f} MiB) leaves {max(left, 0) / 2**20:.0f} MiB after the "
            f"base model and a full step; {remedy}")
