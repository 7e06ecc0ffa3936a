"""Training every job of a run spec to completion in this process (no Ray): load the base once, add
each job's adapter, run fused steps until every job is done, write adapters and metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from actors.engine.data import load_examples, split_eval
from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel, load_base_model
from actors.engine.peft_io import save_adapter
from actors.engine.spec import JobSpec, RunSpec
from actors.engine.trainer import FusedTrainer, StepReport
from policies.base import StepComposer
from policies.registry import load_policy

log = logging.getLogger(__name__)


@dataclass
class JobSummary:
    name: str
    steps: int
    tokens: int
    first_loss: float | None
    final_loss: float | None
    eval_loss: float | None
    adapter_dir: Path


def prepare_job(spec: JobSpec, base: BaseModel, seed: int) -> TrainingJob:
    """Read and tokenize the job's data, split off its eval set, attach its adapter."""
    loaded = load_examples(spec.data, spec.format, base.tokenizer, max_seq_len=spec.max_seq_len,
                           train_on_prompt=spec.train_on_prompt)
    if loaded.dropped:
        log.warning("job %s: %d rows of %s have no target token left after truncation to max_seq_len=%d",
                    spec.name, loaded.dropped, spec.data, spec.max_seq_len)
    train, evaluation = split_eval(loaded.examples, spec.eval_split, seed)
    return TrainingJob.create(spec, base, train, evaluation, seed=seed)


class RunWriter:
    """`<output_dir>/trainer.jsonl` and each job's `metrics.jsonl`, appended as steps finish."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        self.trainer_file = (output_dir / "trainer.jsonl").open("w")
        self.job_files: dict[str, IO[str]] = {}

    def job_dir(self, name: str) -> Path:
        folder = self.output_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def write_step(self, report: StepReport) -> None:
        self.trainer_file.write(json.dumps(report.as_row()) + "\n")
        self.trainer_file.flush()
        for result in report.results:
            if result.optimizer_step is None:
                continue
            handle = self.job_files.get(result.job)
            if handle is None:
                handle = self.job_files[result.job] = (self.job_dir(result.job) / "metrics.jsonl").open("w")
            handle.write(json.dumps(result.optimizer_step.as_row()) + "\n")
            handle.flush()

    def close(self) -> None:
        self.trainer_file.close()
        for handle in self.job_files.values():
            handle.close()


def train_locally(spec: RunSpec, *, base: BaseModel | None = None, progress: bool = True,
                  on_step: Callable[[StepReport], None] | None = None) -> list[JobSummary]:
    """Run every job of `spec` to completion in this process; returns one summary per job."""
    from tqdm import tqdm

    if base is None:
        base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device,
                               quantization=spec.quantization)
    policy = load_policy(spec.policy)   # only its step composition matters here (e.g. minpad)
    trainer = FusedTrainer(base, step_tokens=spec.step_tokens, layout=spec.layout,
                           composer=policy if isinstance(policy, StepComposer) else None)
    jobs = [prepare_job(job_spec, base, spec.job_seed(job_spec)) for job_spec in spec.jobs]
    for job in jobs:
        trainer.add_job(job)
    writer = RunWriter(spec.output_dir)
    bar = tqdm(total=sum(job.total_steps for job in jobs), unit="step", disable=not progress,
               desc=f"{len(jobs)} jobs on {spec.base_model}")
    summaries = []
    try:
        while (report := trainer.train_step()) is not None:
            writer.write_step(report)
            finished_steps = [r for r in report.results if r.optimizer_step is not None]
            bar.update(len(finished_steps))
            if finished_steps:
                bar.set_postfix({r.job: f"{r.optimizer_step.loss:.3f}" for r in finished_steps})
            if on_step is not None:
                on_step(report)
        for job in jobs:
            eval_loss = trainer.evaluate(job) if job.eval_examples else None
            folder = save_adapter(job.adapter, writer.job_dir(job.name), base.source.description)
            history = job.history
            summaries.append(JobSummary(job.name, job.step, job.tokens_seen,
                                        history[0].loss if history else None,
                                        history[-1].loss if history else None, eval_loss, folder))
    finally:
        bar.close()
        writer.close()
        for job in jobs:
            trainer.remove_job(job.name)
    return summaries
