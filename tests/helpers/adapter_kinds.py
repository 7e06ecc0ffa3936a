"""What the adapter-kind tests share (tests/unit/engine/test_adapter_kinds_peft.py, test_adapter_kinds_engine.py):
the tiny models' vocabulary there, and `job`, a JobSpec of three constant-rate steps with an all-linear rank-4 LoRA
of the kind asked for (its LoRA and job fields overridable)."""

from __future__ import annotations

from actors.spec.job_spec import JobSpec

VOCAB = 300


def job(name: str, lora: dict, **fields) -> JobSpec:
    settings = {"data": "unused.jsonl", "format": {"type": "text"}, "batch_size": 2, "max_steps": 3, "lr": 1e-2,
                "lr_schedule": "constant", **fields}
    return JobSpec(name=name, lora={"r": 4, "alpha": 8, "target_modules": "all-linear", **lora}, **settings)
