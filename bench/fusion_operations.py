"""Part (d) of bench/fusion.py (`--proxy`): the operations (aten operators that do work, views left out:
actors/engine/operations.py) one fused step dispatches with 1..32 adapters at equal total tokens, grouped LoRA
and per-segment LoRA side by side, as a ratio to 1 adapter, the optimizer steps' share counted apart. Where a
step is bound by kernel launches (a small model on a GPU) each operation is about one launch: the
machine-independent proxy of fusion efficiency."""

from __future__ import annotations

import random

import torch

from actors.data import Example, TextFormat
from actors.engine import lora_grouped
from actors.engine import trainer as trainer_module
from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel
from actors.engine.operations import OperationCounter, count_operations
from actors.engine.recompute import decoder_layers
from actors.engine.trainer import FusedTrainer
from actors.spec.lora_config import LoraConfig
from bench.fusion_jobs import LORA, job_spec, log, synthetic_example

PROXY_ADAPTERS = (1, 2, 4, 8, 16, 32)


def tiny_llama(device: torch.device, vocab: int = 512, layers: int = 4) -> BaseModel:
    """A small random Llama (the operation count does not depend on the weights' values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.models import from_module

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return from_module(LlamaForCausalLM(config).eval().to(device), None)


def operations_per_step(base: BaseModel, jobs: int, sequences: list[Example], lora_config: LoraConfig = LORA
                        ) -> tuple[int, int]:
    """(all operations, of which the optimizer steps') of one fused step of `jobs` jobs sharing `sequences`
    evenly, after a first step (the optimizers' state is allocated at their first step)."""
    if len(sequences) % jobs:
        raise ValueError(f"{len(sequences)} sequences do not split evenly over {jobs} jobs")
    per_job = len(sequences) // jobs
    trainer = FusedTrainer(base, step_tokens=10**9, layout="packed")
    chosen = []
    for index in range(jobs):
        spec = job_spec(f"ops{jobs}-{index}", TextFormat(), per_job).model_copy(update={"lora": lora_config})
        job = TrainingJob.create(spec, base, sequences, [], seed=index)
        trainer.add_job(job)
        chosen.append((job, sequences[index * per_job:(index + 1) * per_job]))
    trainer.run_step(chosen)
    optimizer = OperationCounter()
    original = trainer_module.step_jobs

    def counted(*args, **kwargs):
        with optimizer:   # nested: the outer counter sees these operations too
            return original(*args, **kwargs)

    trainer_module.step_jobs = counted
    try:
        total = count_operations(lambda: trainer.run_step(chosen))
    finally:
        trainer_module.step_jobs = original
        for job, _ in chosen:
            trainer.remove_job(job.name)
    return total, optimizer.count


def bench_operations(base: BaseModel, adapters: tuple[int, ...] = PROXY_ADAPTERS, seq_len: int = 16) -> dict:
    vocab = int(base.model.config.vocab_size)
    rng = random.Random(4321)
    sequences = [synthetic_example(rng, seq_len, vocab) for _ in range(max(adapters))]
    log(f"(d) operations per fused step: {len(sequences)} x {seq_len} tokens, adapters {list(adapters)}, "
        f"LoRA r={LORA.r} on {', '.join(LORA.target_modules)}, dropout {LORA.dropout}")
    saved = lora_grouped.GROUPING
    rows: dict[str, dict] = {}
    try:
        for mode in ("grouped", "segments"):
            lora_grouped.GROUPING = mode
            counts = {n: operations_per_step(base, n, sequences) for n in adapters}
            first = counts[adapters[0]][0]
            rows[mode] = {str(n): {"operations": total, "optimizer_operations": optimizer,
                                   "ratio_to_1": total / first} for n, (total, optimizer) in counts.items()}
    finally:
        lora_grouped.GROUPING = saved
    log("    adapters  grouped (ratio, of which optimizer)   per segment (ratio, of which optimizer)")
    for n in adapters:
        g, p = rows["grouped"][str(n)], rows["segments"][str(n)]
        log(f"    {n:8d}  {g['operations']:6d} ({g['ratio_to_1']:.3f}, {g['optimizer_operations']:4d})"
            f"            {p['operations']:6d} ({p['ratio_to_1']:.3f}, {p['optimizer_operations']:4d})")
    return {"sequences": len(sequences), "seq_len": seq_len, "lora": LORA.model_dump(),
            "layers": len(decoder_layers(base.decoder)), "per_mode": rows}
