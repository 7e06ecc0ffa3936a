"""The CPU peak-memory estimate (saved tensors + weights + gradients + optimizer state) against an
independent measurement: the allocation timeline recorded by torch.profiler during the same step."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from actors.engine.data import Example
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.spec import JobSpec
from actors.engine.trainer import FusedTrainer


def _profiled_step(tokens: int) -> tuple[int, int, int]:
    """(engine estimate, weights, profiler-measured peak growth of live CPU allocations)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    base = from_module(LlamaForCausalLM(config), None)
    trainer = FusedTrainer(base, step_tokens=tokens)
    rows = tokens // 2 // 128
    for j in range(2):
        examples = [Example(tuple(range(3, 131)), tuple([-100] * 50 + list(range(53, 131))))] * rows
        spec = JobSpec(name=f"j{j}", data="x", format={"type": "text"}, batch_size=rows, max_steps=1,
                       lora={"r": 16, "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=j))
    chosen = trainer.compose()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        report = trainer.run_step(chosen)
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return report.peak_memory_bytes, trainer.meter.weights, peak


@pytest.mark.parametrize("tokens", [1024, 2048])
def test_cpu_peak_estimate_matches_the_profilers_allocation_peak(tokens):
    estimate, weights, measured = _profiled_step(tokens)
    step_bytes = estimate - weights  # weights were allocated before the step, the profiler does not see them
    assert measured > 0
    assert abs(step_bytes - measured) / measured <= 0.2, (step_bytes, measured)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_the_admission_estimate_counts_the_parameters_peft_trains(targets):
    """`policies.adapter_memory` gets plain shapes from `adapted_shapes`; its parameter count is PEFT's for the
    same LoRA config on the same model (16 bytes each: weight, gradient, two AdamW moments)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from actors.engine.lora import adapted_shapes
    from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER, adapter_memory_bytes, adapter_parameters
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    output = model.get_output_embeddings()
    linear_shapes = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and m is not output}
    shapes = adapted_shapes(targets, linear_shapes)
    peft_model = get_peft_model(model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter_parameters(4, shapes) == trained
    assert adapter_memory_bytes(4, shapes) == BYTES_PER_ADAPTER_PARAMETER * trained
