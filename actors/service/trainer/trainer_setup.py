"""A trainer's one-time set-up, Ray-free: its base model loaded once, the one-time costs paid by a warm-up
step, the step-composing policy loaded, and the `TrainerLoop` over them. `TrainerActor` calls this in its own
process, so that the modules it needs (torch, transformers, the engine) are imported there only: the
scheduler that creates trainers, and the driver that creates the scheduler, never import them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from actors.engine.models import load_base_model
from actors.engine.warmup import WARM_UP_MAX_TOKENS, settle_garbage_collector, warm_up
from actors.service.pipeline.pipeline_engine import start_pipeline
from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.step_admission import cpu_budget_config
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.trainer_settings import step_tokens_floor
from policies.base import StepComposer
from policies.registry import load_policy

log = logging.getLogger(__name__)


def loading_phase(base_model: str) -> str:
    """What loading `base_model` does, in words: a GGUF file not yet converted says it is converted once."""
    from actors.storage.sources import cache_root, converted_folder_path, resolve_source

    try:
        source = resolve_source(base_model)
        root = cache_root()
        first = (source.gguf_file is not None and root is not None
                 and not (converted_folder_path(source, root) / "config.json").is_file())
    except (OSError, ValueError) as error:   # the load that follows says what is wrong, with its fix
        log.debug("loading phase of %s: %s", base_model, error)
        first = False
    if first:
        return f"loading {base_model} (its GGUF file is converted once, the first time: about a minute)"
    return f"loading {base_model}"


def start_trainer_loop(trainer_id: str, config: TrainerConfig, state_dir: Path, *, threads: int | None = None,
                       policy: str | None = None, stages: dict[str, Any] | None = None,
                       on_phase: Callable[[str], None] = lambda phase: None, ram_share: float = 1.0) -> TrainerLoop:
    """The trainer's loop over its base model. `threads`: torch's thread count (None: torch's default);
    `policy`: the service's policy, which the trainer loads where it composes steps (`compose_step`, e.g.
    minpad) to let it choose which jobs share each step. `stages`: with `stages: N`, how the other stages
    start (`start_pipeline`'s starter, address and on_close: Ray's stage actors); default: as processes of
    this one. `on_phase(text)`: hears each phase of the set-up as it begins (loading the base, warming up,
    measuring memory), for the people waiting on it. `ram_share`: a CPU trainer's share of this node's RAM, where
    other CPU trainers' processes share it (cluster_plan.py): its default memory budget is that share of half the
    RAM (`cpu_budget_config`)."""
    config = cpu_budget_config(config, ram_share)
    if threads:
        torch.set_num_threads(threads)
    composer = load_policy(policy) if policy else None
    if config.stages > 1:   # the base cut into stages; the pipeline's head composes the steps (no policy does)
        on_phase(f"starting {config.stages} pipeline stages of {config.base_model}")
        engine = start_pipeline(config, threads=threads, **(stages or {}))
        log.info("trainer %s: %s in %d pipeline stages (layers %s), %d torch threads each", trainer_id,
                 config.base_model, config.stages, engine.pipeline.split, torch.get_num_threads())
        return TrainerLoop(None, config, trainer_id, state_dir, engine=engine)
    device = "cuda" if config.num_gpus > 0 else "cpu"
    on_phase(loading_phase(config.base_model))
    base = load_base_model(config.base_model, dtype=config.dtype, device=device, quantization=config.quantization,
                           kernels=config.kernels)
    # one-time costs, before any job's first step
    tokens = step_tokens_floor(config.step_tokens)
    on_phase(f"warming up (one step of up to {min(tokens, WARM_UP_MAX_TOKENS)} tokens)")
    warm_up_seconds = warm_up(base, tokens)
    settle_garbage_collector()
    on_phase("measuring a step's memory (probe steps)")
    loop = TrainerLoop(base, config, trainer_id, state_dir, composer if isinstance(composer, StepComposer) else None)
    log.info("trainer %s: %s on %s, %d torch threads, warm-up step %.2fs", trainer_id, config.base_model,
             base.device, torch.get_num_threads(), warm_up_seconds)
    return loop
