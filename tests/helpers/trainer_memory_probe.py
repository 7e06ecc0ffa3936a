"""A real trainer's steps against the trainer loop's memory prediction, in a process of its own: run as
`python -m tests.helpers.trainer_memory_probe`, prints one JSON line (each step's shape, prediction and the
allocator's count, and the CPU it ran on).

Jobs of different adapter sizes and data arrive over time, as in a service; each step's peak is predicted by
`StepAdmission` (the trainer loop's prior from probe steps on this model, corrected online by the steps it
measured) before the step runs, then counted by the allocator (torch.profiler's memory records, not the
engine's arithmetic). A process of its own, as a trainer actor has: what earlier tests left in a shared
process (threads, patched modules, the heap) is not part of a trainer's step."""

from __future__ import annotations

import json
import platform
import random
from pathlib import Path

from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch
from actors.engine.trainer import FusedTrainer
from actors.service.trainer.step_admission import StepAdmission
from actors.spec.job_spec import JobSpec
from tests.helpers.models import random_examples, tiny_model

STEPS, JOIN_EVERY = 40, 8


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> dict:
    base = from_module(tiny_model("llama"), None)
    trainer = FusedTrainer(base, step_tokens=1024)
    admission = StepAdmission(trainer)
    rng = random.Random(1)
    steps = []
    for step in range(STEPS):
        if step % JOIN_EVERY == 0:
            index = len(trainer.jobs)
            spec = JobSpec(name=f"j{index}", data="unused.jsonl", format={"type": "text"}, max_steps=1000,
                           batch_size=rng.randint(2, 6), lora={"r": 4 * (index + 1), "target_modules": "all-linear"})
            examples = random_examples(index, 64, min_len=8, max_len=rng.choice([40, 120, 200]))
            trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=index))
        chosen = trainer.compose()
        shape = admission.shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
        predicted = admission.predict(shape)
        report = trainer.run_step(chosen, measure=True)
        steps.append({"step": step, "jobs": len(chosen), "sequences": sum(len(b) for _, b in chosen),
                      "tokens": report.tokens, "predicted": predicted, "measured": report.peak_memory_bytes,
                      "memory_measured": report.memory_measured})
        admission.observe(shape, report, predicted)
    return {"cpu": cpu_name(), "measured_steps": admission.measured_steps, "steps": steps}


if __name__ == "__main__":
    print(json.dumps(main()))
