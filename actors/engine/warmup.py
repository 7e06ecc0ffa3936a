"""Throwaway fused steps on a freshly loaded base model, so that a trainer's first real step does not
pay the process's one-time costs: the allocator's first blocks, kernel and library initialisation (on
CUDA: cuBLAS handles and workspaces, attention kernels), the first pass through every Python code path.
Measured on a model whose steps are bound by per-operation overhead, as a small model's are on a GPU: the
first step of a fresh process took 1.0 s against 0.37 s for the steps after it, and the next two were
still slow (0.46 s, 0.56 s).

Two temporary jobs (two, so that the multi-adapter code paths run too) train on random tokens and are
removed, in two steps whose token counts are one a multiple of 16 and one not (Triton compiles a kernel
anew for an integer argument that turns divisible by 16); the base model is left as it was: no adapter
attached, its weights untouched, the random number generators' states restored, and on CUDA the
peak-memory counter reset.

`settle_garbage_collector` is the other start-up step of a long-lived training process: after loading
torch, transformers (and Ray) such a process holds ~420,000 objects the garbage collector tracks, and
every full collection walked all of them: 0.23 s, inside a fused step, about every 18 steps of 0.37 s
(counted with `gc.callbacks` in a trainer actor). Frozen after start-up, they are left out of every later
collection; objects made afterwards are collected as before."""

from __future__ import annotations

import atexit
import functools
import gc
import time

import torch

from actors.data import Example
from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec

WARM_UP_JOBS = 2
WARM_UP_MAX_TOKENS = 1024    # the warm-up step's size: the trainer's token budget, up to this
WARM_UP_MAX_LENGTH = 128     # tokens per sequence


def warm_up(base: BaseModel, step_tokens: int = 256) -> float:
    """Run two fused steps of temporary jobs on `base` and remove them; returns the seconds they took. A
    step is about as large as the trainer's steps will be (`step_tokens`, its budget, up to
    `WARM_UP_MAX_TOKENS`): the first step of a size touches memory the process has not touched yet
    (measured: a first 700-token step 0.9 s after a warm-up of 128 tokens, 0.37 s for the next ones)."""
    started = time.perf_counter()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if base.device.type == "cuda" else None
    vocab = base.model.get_input_embeddings().num_embeddings
    tokens = max(2 * WARM_UP_JOBS, min(step_tokens, WARM_UP_MAX_TOKENS))
    length = max(8, min(WARM_UP_MAX_LENGTH, tokens // WARM_UP_JOBS) // 8 * 8)   # the first step: a multiple of 16
    sequences = max(1, tokens // (WARM_UP_JOBS * length))   # per job
    generator = torch.Generator().manual_seed(0)
    try:
        # two steps: their token counts one a multiple of 16 and one not, the two ways Triton specialises a
        # kernel's integer arguments (a step's token count reaches Liger's RoPE and RMSNorm so): each kernel is
        # compiled for both before the first real step, not in the step whose count first differs (on the H200
        # lease of 2026-12-04 three kernels were compiled anew in the timed step of 3,328 tokens)
        for shorter in (0, 1):
            _one_step(base, vocab, sequences, length, shorter, generator)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
            torch.cuda.reset_peak_memory_stats(base.device)
    return time.perf_counter() - started


def _one_step(base: BaseModel, vocab: int, sequences: int, length: int, shorter: int,
              generator: torch.Generator) -> None:
    """One fused step of WARM_UP_JOBS temporary jobs, each `sequences` sequences of `length` tokens (the first job's
    last one `shorter` tokens shorter), the jobs removed after it."""
    trainer = FusedTrainer(base, step_tokens=10**9, layout="packed")
    chosen: list[tuple[TrainingJob, list[Example]]] = []
    try:
        for index in range(WARM_UP_JOBS):
            spec = JobSpec(name=f"aspen-warm-up-{index}", data="(warm-up)", format={"type": "text"},
                           batch_size=sequences, max_steps=1,
                           lora={"r": 8, "alpha": 16, "target_modules": "all-linear"})
            examples = []
            for sequence in range(sequences):
                size = length - (shorter if index == 0 and sequence == sequences - 1 else 0)
                ids = tuple(torch.randint(0, vocab, (size,), generator=generator).tolist())
                examples.append(Example(ids, (-100,) + ids[1:]))
            job = TrainingJob.create(spec, base, examples, [], seed=index)
            trainer.add_job(job)
            chosen.append((job, examples))
        trainer.run_step(chosen)
    finally:
        for job, _ in chosen:
            trainer.remove_job(job.name)


def settle_garbage_collector() -> None:
    """Collect once, then move every object alive now out of the collector's sight (`gc.freeze`): the
    start-up's modules, model and tokenizer live as long as the process does. They are handed back at the
    process's exit, so that its last collection frees them (frozen, Triton's bindings reported hundreds of
    "leaked" objects at every exit)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """`gc.unfreeze` at the process's exit, registered once however often the collector is settled."""
    atexit.register(gc.unfreeze)
