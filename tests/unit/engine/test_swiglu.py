"""The lean SwiGLU (actors/engine/swiglu.py) against transformers' own MLP: the same logits and gradients bit for
bit (float32 and bfloat16, three architectures), with one intermediate-width tensor per layer fewer kept for
backward (counted by autograd's saved-tensor hooks)."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine.swiglu import lean_swiglu
from tests.helpers.models import tiny_model


def _run(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logits, every gradient (the frozen base's too: the backward reaches all of it) and the bytes of the
    tensors autograd kept for backward (each storage once)."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids, use_cache=False).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return logits.detach(), grads, sum(n for ptr, n in kept.items() if ptr not in parameters)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_swiglu_computes_the_models_own_values_and_keeps_less(arch, dtype):
    reference = tiny_model(arch).to(dtype).train()
    lean = copy.deepcopy(reference)
    layers = lean.config.num_hidden_layers
    assert lean_swiglu(lean) == layers
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads, want_kept = _run(reference, ids)
    got_logits, got_grads, got_kept = _run(lean, ids)
    assert torch.equal(got_logits, want_logits)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    element = torch.empty((), dtype=dtype).element_size()
    intermediate = ids.numel() * lean.config.intermediate_size * element
    assert want_kept - got_kept == layers * intermediate


def test_a_model_without_a_silu_gate_is_left_as_it_is():
    model = tiny_model("llama")
    model.config.hidden_act = "gelu"
    assert lean_swiglu(model) == 0
