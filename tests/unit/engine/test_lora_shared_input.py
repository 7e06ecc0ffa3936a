"""Grouped LoRA's copies of the layers' inputs: with bfloat16 layers and float32 adapters each adapted layer's
LoRA reads its input cast to float32 (and gathered into the group's batch), a copy autograd holds until the
backward. Layers that read one input tensor (q, k and v; gate and up) share one copy, so the copies held
are one per distinct input the adapted layers receive, counted here by hooks on the layers themselves."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from actors.engine import fused_linear, lora_grouped
from actors.engine.job import TrainingJob
from actors.engine.layout import step_layout
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch, pack
from tests.helpers.fused import job_spec
from tests.helpers.models import random_examples, tiny_config

VOCAB = 300


def test_layers_reading_one_input_hold_one_float32_copy_of_it(monkeypatch):
    monkeypatch.setattr(lora_grouped, "GROUPING", "grouped")
    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(tiny_config("llama", VOCAB)).to(torch.bfloat16), None)
    examples = random_examples(0, count=6, vocab=VOCAB, min_len=10, max_len=14)
    jobs = [TrainingJob.create(job_spec(f"job-{index}", batch_size=3), base, examples, [], seed=index)
            for index in range(2)]
    assert all(p.dtype == torch.float32 for job in jobs for p in job.adapter.parameters())
    batch = pack([JobMicroBatch(job.name, examples[3 * i:3 * i + 3]) for i, job in enumerate(jobs)], "packed",
                 base.pad_token_id)
    inputs: dict[int, torch.Tensor] = {}   # every distinct input an adapted layer received (kept alive)
    hooks = [module.register_forward_pre_hook(lambda _, args: inputs.setdefault(id(args[0]), args[0]))
             for module in base.model.modules() if isinstance(module, fused_linear.FusedLoraLinear)]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with step_layout(batch.layout):
            hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                  attention_mask=None, use_cache=False).last_hidden_state
    for hook in hooks:
        hook.remove()
    # the copies as the batched products hold them: (jobs, in, longest), the group's segments padded to the
    # longest (the stacked A matrices, (jobs, rank, in), are float32 and 3-dimensional too: not these)
    longest = max(end - start for _, start, end in batch.layout.segments)
    widths = {x.shape[-1] for x in inputs.values()}
    copies = {t.untyped_storage().data_ptr() for t in saved
              if t.dtype == torch.float32 and t.dim() == 3 and t.shape[0] == len(jobs) and t.shape[1] in widths
              and t.shape[2] == longest}
    layers = len(base.decoder.layers)
    assert len(inputs) == 4 * layers            # per layer: q/k/v's input, o's, gate/up's, down's
    assert len(copies) == len(inputs), (len(copies), len(inputs))
    hidden.float().sum().backward()   # every layer's B gets its gradient through the shared copies (A's is 0:
    assert all(p.grad is not None and (p.grad.abs().sum() > 0 or "lora_A" in name)   # B starts at 0)
               for job in jobs for name, p in job.adapter.named_parameters())
