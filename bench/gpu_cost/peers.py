"""The single-job PEFT setups bench/lora_mfu.py measures aspen against, recorded on the virtual device as that
benchmark runs them: its side (a), the careful padded PEFT loop, and its side (b), PEFT over packed rows with a
varlen attention and Liger's kernels, with bfloat16 or float32 adapters (the faster counts there). The code run
is the checkout's own bench/peft_baselines.py (`run_jobs`: a warm-up adapter, then each job in turn with a fresh
adapter, its sequences sorted by length, `per_step` a step); only its step clock is replaced, by one that cuts
the recorded operations into the segments its CUDA events would time."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gpu_cost.operations import Op
from gpu_cost.virtual_cuda import CUDA
from gpu_cost.workload import WARMUP, Recorded, Session, _matmul_parameters, _model, flash_sdpa, shapes


@dataclass(frozen=True)
class Peer:
    packed: bool
    float32_adapters: bool
    side: str           # bench/lora_mfu.py's name for it


PEERS = {
    "peft": Peer(packed=False, float32_adapters=True, side="(a) PEFT loop, padded, jobs in turn"),
    "packed-bf16": Peer(packed=True, float32_adapters=False, side="(b) PEFT packed varlen + Liger, bf16 adapters"),
    "packed-float32": Peer(packed=True, float32_adapters=True,
                           side="(b) PEFT packed varlen + Liger, float32 adapters"),
}


def baselines_module(checkout: Path) -> ModuleType:
    """The checkout's bench/peft_baselines.py (after `benchmark_module` made what it imports importable: its
    lora_bench, or an older checkout's lora_mfu)."""
    path = checkout / "bench" / "peft_baselines.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the PEFT baselines are the checkout's bench/peft_baselines.py")
    spec = importlib.util.spec_from_file_location("peft_baselines", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peft_baselines"] = module
    spec.loader.exec_module(module)
    return module


class SegmentClock:
    """Stands in for bench/lora_mfu.py's StepClock inside `run_jobs`: each mark ends a segment of the recorded
    operations (what ran since the mark before), where the benchmark records a CUDA event."""

    def __init__(self, session: Session):
        self.session = session
        self.segments: list[list[Op]] = []

    def mark(self) -> None:
        self.segments.append(self.session.recorder.take())

    def seconds(self) -> list[float]:   # run_jobs slices these per job; the model times the segments itself
        return [0.0] * max(len(self.segments) - 1, 0)


def record_peer(session: Session, bench: ModuleType, checkout: Path, shape: str, peer: str, steps: int,
                warmup: int = WARMUP, per_step: int | None = None) -> tuple[Recorded, list[int], dict]:
    """One PEFT side of bench/lora_mfu.py over the same sequences as its aspen side (`warmup` + `steps` batches of
    each job's `job_batches`): (the recorded segments, the indices of the timed steps among them, what the
    side reports besides). Segment 0 holds the warm-up adapter's steps and the first job's set-up; after each
    job's steps, a segment holds its adapter's removal and the next one's set-up (untimed, as there)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")
    setup = PEERS[peer]
    baselines = baselines_module(checkout)
    config = shapes(bench)[shape]
    model = _model(config, torch.bfloat16)
    notes = [setup.side]
    if setup.packed:
        model.set_attn_implementation(baselines.PACKED_ATTENTION)
        liger = baselines.apply_liger(model)
        notes.append("Liger's kernels" if liger is None else f"without Liger's kernels: {liger}")
    batches = {job: bench.job_batches(job, warmup + steps, config["vocab_size"]) for job in range(bench.JOBS)}
    timed = {job: [s for batch in job_batches[warmup:] for s in batch] for job, job_batches in batches.items()}
    warm = [s for job_batches in batches.values() for batch in job_batches[:warmup] for s in batch]
    per_step = per_step or bench.PEFT_SEQUENCES_PER_STEP
    clocks: list[SegmentClock] = []

    def clock(device: Any) -> SegmentClock:
        clocks.append(SegmentClock(session))
        return clocks[-1]

    original = baselines.StepClock
    baselines.StepClock = clock
    try:
        with flash_sdpa():   # the padded loop's sdpa with its padding mask, as CUDA runs it
            run, tail = session.record(lambda: baselines.run_jobs(
                model, timed, warm, CUDA, per_step=per_step, packed=setup.packed,
                float32_adapters=setup.float32_adapters))
    finally:
        baselines.StepClock = original
    segments = [*clocks[0].segments, tail]
    per_job = [len(baselines.sorted_batches(s, per_step, 0)) for s in timed.values()]
    indices, index = [], 1   # segment 0: before the first job's opening mark
    for count in per_job:
        indices += range(index, index + count)
        index += count + 1    # the job's steps, then the segment up to the next job's opening mark
    tokens = [0] * len(segments)
    for position, real in zip(indices, run["tokens"], strict=True):
        tokens[position] = real
    recorded = Recorded(segments, tokens, _matmul_parameters(model), notes=notes)
    recorded.unknown_values = sorted(session.recorder.unknown_values)
    side = {"peer": peer, "side": setup.side, "adapter_dtype": run["adapter_dtype"], "per_step": per_step,
            "padded_tokens": sum(run["padded_tokens"]), "real_tokens": sum(run["tokens"])}
    return recorded, indices, side
