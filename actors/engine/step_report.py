"""What a fused step reports, as plain data: each job's part in it (`JobStepResult`) and the step's row of
trainer.jsonl with the per-job results (`StepReport`). The single-device trainer (actors/engine/trainer.py) and
the pipeline engine (actors/service/pipeline/pipeline_engine.py) return it; the trainer loop, its memory
admission and its step log read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.step_records import OptimizerStepRecord


@dataclass(kw_only=True)
class JobStepResult:
    job: str
    loss: float            # mean over the job's target tokens in this micro-batch
    tokens: int            # real tokens of the job's micro-batch
    targets: int
    optimizer_step: OptimizerStepRecord | None


@dataclass(kw_only=True)
class StepReport:
    """One row of trainer.jsonl (plus per-job results)."""

    step: int
    jobs: list[str]
    tokens: int            # tokens processed, padding included
    padding_tokens: int
    seconds: float
    peak_memory_bytes: int
    sequence_lengths: list[int] = field(default_factory=list)
    results: list[JobStepResult] = field(default_factory=list)
    # peak_memory_bytes counted by the allocator (CUDA always; CPU when the step ran with `measure`), not
    # the saved-tensor estimate of `StepMemoryMeter`
    memory_measured: bool = False
    # `compile: graphs`: the step replayed a captured graph (its activations lie in the graph's pool, which the
    # allocator does not count as the step's: its peak is not measured)
    replayed: bool = False
    # CPU (Linux): the process's peak resident set during the step, its start included (what the kernel counts)
    resident_peak_bytes: int | None = None
    # interactive models' forward_backward calls that shared the step (`FusedTrainer.run_step`'s `calls`): each
    # one's output, and their tokens (in `tokens`, not in any job's result)
    call_outputs: list = field(default_factory=list)
    call_tokens: int = 0

    def as_row(self) -> dict:
        return {"step": self.step, "jobs": self.jobs, "tokens": self.tokens,
                "padding_tokens": self.padding_tokens, "seconds": round(self.seconds, 6),
                "peak_memory_bytes": self.peak_memory_bytes, "memory_measured": self.memory_measured,
                "resident_peak_bytes": self.resident_peak_bytes, "replayed": self.replayed}
