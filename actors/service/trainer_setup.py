"""A trainer's one-time set-up, Ray-free: its base model loaded once, the one-time costs paid by a warm-up
step, the step-composing policy loaded, and the `TrainerLoop` over them. `TrainerActor` calls this in its own
process, so that the modules it needs (torch, transformers, the engine) are imported there only: the
scheduler that creates trainers, and the driver that creates the scheduler, never import them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from actors.engine.models import load_base_model
from actors.engine.spec import step_tokens_floor
from actors.engine.warmup import settle_garbage_collector, warm_up
from actors.service.config import TrainerConfig
from actors.service.pipeline_engine import start_pipeline
from actors.service.trainer_loop import TrainerLoop
from policies.base import StepComposer
from policies.registry import load_policy

log = logging.getLogger(__name__)


def start_trainer_loop(trainer_id: str, config: TrainerConfig, state_dir: Path, *, threads: int | None = None,
                       policy: str | None = None, stages: dict[str, Any] | None = None) -> TrainerLoop:
    """The trainer's loop over its base model. `threads`: torch's thread count (None: torch's default);
    `policy`: the service's policy, which the trainer loads where it composes steps (`compose_step`, e.g.
    minpad) to let it choose which jobs share each step. `stages`: with `stages: N`, how the other stages
    start (`start_pipeline`'s starter, address and on_close: Ray's stage actors); default: as processes of
    this one."""
    if threads:
        torch.set_num_threads(threads)
    composer = load_policy(policy) if policy else None
    if config.stages > 1:   # the base cut into stages; the pipeline's head composes the steps (no policy does)
        engine = start_pipeline(config, threads=threads, **(stages or {}))
        log.info("trainer %s: %s in %d pipeline stages (layers %s), %d torch threads each", trainer_id,
                 config.base_model, config.stages, engine.pipeline.split, torch.get_num_threads())
        return TrainerLoop(None, config, trainer_id, state_dir, engine=engine)
    device = "cuda" if config.num_gpus > 0 else "cpu"
    base = load_base_model(config.base_model, dtype=config.dtype, device=device, quantization=config.quantization,
                           kernels=config.kernels)
    # one-time costs, before any job's first step
    warm_up_seconds = warm_up(base, step_tokens_floor(config.step_tokens))
    settle_garbage_collector()
    loop = TrainerLoop(base, config, trainer_id, state_dir, composer if isinstance(composer, StepComposer) else None)
    log.info("trainer %s: %s on %s, %d torch threads, warm-up step %.2fs", trainer_id, config.base_model,
             base.device, torch.get_num_threads(), warm_up_seconds)
    return loop
