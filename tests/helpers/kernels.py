"""The fused-kernel tests' model and step (tests/unit/engine/test_kernels*.py, tests/gpu/test_kernels_cuda.py): a tiny
random model of a given architecture, and one packed step of two jobs through it, with a chosen set of Liger's
kernels swapped in, returning what the comparisons read."""

from __future__ import annotations

import collections
import importlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.engine import kernels
from actors.engine.adapter_surgery import add_adapter
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.models import from_module
from actors.spec.lora_config import LoraConfig

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
SEQUENCES = ((0, 12), (12, 25), (25, 33), (33, 45))      # four packed sequences
LONGEST = max(end - start for start, end in SEQUENCES)
SEGMENTS = (("a", 0, 25), ("b", 25, 45))                  # two jobs
TOKENS = SEQUENCES[-1][1]
JOB_WEIGHTS = {"a": 1.0, "b": 2.0}                        # a token weight per job (1, or a float16 loss scale)
SPIED = {"rms_norm": "liger_rms_norm", "add_rms_norm": "liger_fused_add_rms_norm", "swiglu": "liger_swiglu",
         "rope": "liger_rope", "loss": "cross_entropy"}


def tiny(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random float32 model on the CPU whose norm weights are not all ones (so that the norm's product with
    its weight counts)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.2)
    return model


def forwards_rebound(model: torch.nn.Module) -> list[str]:
    """The modules whose `forward` is no longer their class's own."""
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def spy_on_liger(monkeypatch) -> collections.Counter:
    """Counts the calls of each Liger kernel aspen uses (SPIED's names)."""
    calls: collections.Counter = collections.Counter()
    functional = importlib.import_module("liger_kernel.transformers.functional")
    for name in ("liger_rms_norm", "liger_fused_add_rms_norm", "liger_swiglu", "liger_rope"):
        monkeypatch.setattr(functional, name, _counting(getattr(functional, name), name, calls))
    cross_entropy = importlib.import_module("liger_kernel.ops.cross_entropy")
    kernel = cross_entropy.liger_cross_entropy_kernel

    class Launches:
        def __getitem__(self, grid):
            calls["cross_entropy"] += 1
            return kernel[grid]

    monkeypatch.setattr(cross_entropy, "liger_cross_entropy_kernel", Launches())
    return calls


def _counting(function, name: str, calls: collections.Counter):
    def spy(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)

    return spy


def fused_step(model: torch.nn.Module, ops: tuple[str, ...], rank: int = 4) -> dict[str, torch.Tensor]:
    """One packed step of two jobs through `model` (on its device, in its dtype) with Liger's `ops` swapped in
    (none: the model's own operations): its final hidden states, the per-token losses, the gradient of the input
    embeddings and of every adapter weight (float32 adapters, B drawn non-zero), all in float32."""
    base = from_module(model, None, kernels="none")
    if ops:
        kernels.apply_kernels(model, "liger", ops=ops)
    device = base.device
    config = LoraConfig(r=rank, alpha=2 * rank, target_modules="all-linear")
    handles = {name: add_adapter(model, name, config, seed=index) for index, name in enumerate(JOB_WEIGHTS)}
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for handle in handles.values():
            for adapter in handle.layers.values():
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=generator) * 0.1)
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=generator).to(device)
    positions = torch.cat([torch.arange(end - start) for start, end in SEQUENCES])[None].to(device)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with step_layout(StepLayout(SEGMENTS, SEQUENCES, TOKENS)):
        hidden = base.decoder(inputs_embeds=embeddings, position_ids=positions).last_hidden_state[0]
    index = torch.tensor([p for start, end in SEQUENCES for p in range(start, end - 1)], device=device)
    weights = torch.tensor([next(JOB_WEIGHTS[n] for n, s, e in SEGMENTS if s <= p < e) for p in index.tolist()],
                           device=device)
    head = base.lm_head
    total, losses = target_cross_entropy(hidden[index], head.weight, head.bias, ids[0, index + 1], weights, 16,
                                         base.logit_transform)
    total.backward()
    result = {"hidden": hidden.detach().float(), "losses": losses, "input gradient": embeddings.grad[0].float()}
    for name, handle in handles.items():
        for layer, adapter in handle.layers.items():
            result[f"{name}/{layer}.A"] = adapter.lora_A.grad
            result[f"{name}/{layer}.B"] = adapter.lora_B.grad
    return result
