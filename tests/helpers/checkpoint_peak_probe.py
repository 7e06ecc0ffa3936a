"""Measures what a job's end writes (its adapter, then its checkpoint, as a trainer writes them when a job
completes), or an interactive model's saved state (the Tinker API's save_state: adapter and AdamW moments),
adds to the process's peak resident set, in a process of its own: run as
`python -m tests.helpers.checkpoint_peak_probe FOLDER [job|interactive]`, prints one JSON line: the adapter's
and the optimizer moments' bytes and the peak resident growth over the writes. A process of its own, so that no
free heap pages that earlier work left resident can take the writes' copies unseen (glibc reuses them without
raising VmHWM)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.checkpoint import save_checkpoint
from actors.checkpoint.interactive_state import save_state
from actors.checkpoint.peft_io import import_peft, save_adapter
from actors.data import Example
from actors.engine.interactive_model import MAX_RANK, AdamStep, InteractiveModel
from actors.engine.job import TrainingJob
from actors.engine.memory import measure_resident, release_free_heap, tensor_bytes
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec

# A narrow model with a wide adapter: r=1024 on every linear layer of two 256-wide layers is ~14M float32
# parameters (56 MiB), its AdamW moments twice that: copies of them stand far above the process's noise.
CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
                        and v.dim() > 0)


def interactive(folder: Path) -> None:
    """An interactive model of the largest rank on a wider base (its adapter ~17 MiB), one AdamW step taken."""
    torch.manual_seed(0)
    wider = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    base = from_module(LlamaForCausalLM(wider), None)
    model = InteractiveModel(base, "wide", MAX_RANK)
    for parameter in model.adapter.parameters():
        parameter.grad = torch.randn_like(parameter)
    model.optim_step(AdamStep())   # the moments exist from the first step on
    adapter, moments = tensor_bytes(model.adapter.parameters()), moment_bytes(model.optimizer)
    import_peft()
    release_free_heap()
    _, growth = measure_resident(lambda: save_state(model, folder / "state", "tiny", "wide-model", "alice"))
    print(json.dumps({"adapter_bytes": adapter, "moment_bytes": moments, "peak_growth_bytes": growth}))


def main(folder: Path) -> None:
    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(CONFIG), None)
    spec = JobSpec(name="wide", data="x", format={"type": "text"}, batch_size=2, max_steps=2,
                   lora={"r": 1024, "alpha": 16, "target_modules": "all-linear"})
    data = [Example(tuple(range(1, 33)), (-100, *range(2, 33))) for _ in range(4)]
    job = TrainingJob.create(spec, base, data, [], seed=0)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    trainer.train_step()   # the AdamW moments exist from the first step on
    adapter, moments = tensor_bytes(job.adapter.parameters()), moment_bytes(job.optimizer.optimizer)
    import_peft()   # as a trainer does as it starts (its first write would import it: ~50 MiB resident)
    release_free_heap()

    def write() -> None:   # as job_ends.JobEnds.finish writes a completed job's results
        save_adapter(job.adapter, folder / "adapter", "tiny")
        save_checkpoint(job, folder / "checkpoint", "tiny")

    _, growth = measure_resident(write)
    print(json.dumps({"adapter_bytes": adapter, "moment_bytes": moments, "peak_growth_bytes": growth}))


if __name__ == "__main__":
    {"job": main, "interactive": interactive}[sys.argv[2] if len(sys.argv) > 2 else "job"](Path(sys.argv[1]))
