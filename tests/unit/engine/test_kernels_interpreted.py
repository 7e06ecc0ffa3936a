"""Liger-Kernel's kernels as `kernels: liger` swaps them in (actors/engine/kernels.py, the fused loss in loss.py),
run on the CPU under Triton's interpreter, in float32, against the Hugging Face model's own operations.

This module runs in a process started with TRITON_INTERPRET=1 (tests/helpers/triton_interpreter.py says why and
what the interpreter lacks; tests/unit/engine/test_kernels.py starts it where Liger-Kernel is installed) and
skips itself elsewhere. Each kernel switched on alone, then all five, on a tiny Llama and a tiny Qwen3 (q/k norms
before RoPE): a packed step of two jobs, each with its own non-zero LoRA adapter, gives the model's hidden states,
per-token losses, input gradient and adapter gradients within float32's rounding bound of the same model without
kernels (tests/helpers/tolerances.py: the two differ in summation order only), and each kernel asked for is shown
to have run, the others not (a spy on each); Mistral (a sliding window) and Qwen2 (q/k/v biases) with all five.
Jobs trained fused on a base with all five kernels end bit for bit where they end trained alone (the kernels work
token by token: kernels.py's isolation argument), and recomputed layers end where kept ones do. An architecture
without Liger's kernels (Gemma: a GeGLU MLP, an offset RMSNorm) trains with the fused loss alone. The fused loss,
with each logit transform, a bias and per-token weights, against autograd in float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from actors.engine import kernels
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy, target_log_probs, use_fused_loss
from actors.engine.model_support import LogitTransform
from actors.engine.models import from_module
from actors.spec.job_spec import JobSpec
from tests.helpers.isolation import assert_isolated, train_fused
from tests.helpers.kernels import LONGEST, SPIED, TOKENS, VOCAB, forwards_rebound, fused_step, spy_on_liger, tiny
from tests.helpers.models import random_examples
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance
from tests.helpers.triton_interpreter import liger_interpreted

pytestmark = pytest.mark.skipif(not liger_interpreted(),
                                reason="needs Liger-Kernel and Triton's interpreter on from the process's start "
                                       "(TRITON_INTERPRET=1): tests/unit/engine/test_kernels.py runs it so")


@pytest.fixture
def spied(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # set already; kernels: liger then runs on a CPU
    return spy_on_liger(monkeypatch)


def assert_within_rounding(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], config) -> None:
    terms = {backward: llama_chain_terms(config, sequence=LONGEST, tokens=TOKENS, backward=backward)
             for backward in (False, True)}
    assert reference.keys() == got.keys()
    for key, expected in reference.items():
        bound = rounding_tolerance(terms[key not in ("hidden", "losses")], float(expected.abs().max()))
        assert float((got[key] - expected).abs().max()) <= bound, key


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("ops", [("rms_norm",), ("add_rms_norm",), ("rope",), ("swiglu",), ("loss",),
                                 kernels.OPS],
                         ids=["rms_norm", "add_rms_norm", "rope", "swiglu", "loss", "all"])
def test_each_kernel_gives_the_model_s_hidden_states_losses_and_gradients(spied, model_type, ops):
    model = tiny(model_type)
    reference = fused_step(copy.deepcopy(model), ())
    assert sum(spied.values()) == 0
    got = fused_step(model, ops)
    for op, counted in SPIED.items():   # each kernel asked for ran, the others did not
        assert (spied[counted] > 0) == (op in ops), (op, dict(spied))
    assert_within_rounding(got, reference, model.config)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_the_other_architectures_with_every_kernel(spied, model_type):
    model = tiny(model_type, **({"sliding_window": 8} if model_type == "mistral" else {}))
    reference = fused_step(copy.deepcopy(model), ())
    got = fused_step(model, kernels.OPS)
    assert all(spied[name] > 0 for name in SPIED.values())
    assert_within_rounding(got, reference, model.config)


def two_jobs() -> list:
    jobs = []
    for index, (shortest, longest, lora) in enumerate([(4, 10, {"r": 4, "alpha": 8}),
                                                       (8, 24, {"r": 8, "alpha": 16, "dropout": 0.1})]):
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=1,
                       lr=1e-2, lora={"target_modules": "all-linear", **lora})
        jobs.append((spec, random_examples(index, count=2, vocab=VOCAB, min_len=shortest, max_len=longest), index))
    return jobs


def test_jobs_fused_on_liger_s_kernels_end_as_they_end_alone(spied):
    base = from_module(tiny("llama"), None, kernels="liger")
    assert base.kernels == "liger"
    assert_isolated(base, two_jobs())
    assert all(spied[name] > 0 for name in SPIED.values())


def test_a_layer_s_last_addition_and_the_next_layer_s_input_norm_are_one_kernel_in_a_step(spied):
    """In a step (a layout), each layer but the last computes the next one's input norm with its MLP's residual
    addition: on 3 layers, 3 + 2 fused additions and norms, and Liger's RMSNorm for the first layer's input norm and the
    model's final norm only; outside a step (no layout), 3 + 0 and 3 + 1. The hidden states agree either way, and with
    the model's own operations, within float32's rounding."""
    model = tiny("llama", num_hidden_layers=3)
    reference = copy.deepcopy(model)
    kernels.apply_kernels(model, "liger")
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(TOKENS)[None]
    with torch.no_grad():
        expected = reference.model(input_ids=ids, position_ids=positions).last_hidden_state
        outside = model.model(input_ids=ids, position_ids=positions).last_hidden_state
        counted = dict(spied)
        with step_layout(StepLayout((("a", 0, TOKENS),), ((0, TOKENS),), TOKENS)):
            inside = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    assert (counted["liger_fused_add_rms_norm"], counted["liger_rms_norm"]) == (3, 4)
    assert (spied["liger_fused_add_rms_norm"] - 3, spied["liger_rms_norm"] - 4) == (5, 2)
    bound = rounding_tolerance(llama_chain_terms(model.config, sequence=TOKENS, tokens=TOKENS, backward=False),
                               float(expected.abs().max()))
    assert float((outside - expected).abs().max()) <= bound and float((inside - expected).abs().max()) <= bound


def test_recomputed_layers_run_liger_s_kernels_again_to_the_same_adapters(spied):
    """recompute: layers runs each layer's forward again in backward: with Liger's kernels (RoPE's in place among
    them) the adapters end bit for bit where they end without recomputation."""
    base = from_module(tiny("qwen3"), None, kernels="liger")
    kept, _, _ = train_fused(base, two_jobs())
    calls = spied["liger_rope"]
    recomputed, _, _ = train_fused(base, two_jobs(), recompute="layers")
    assert spied["liger_rope"] > 2 * calls   # the recomputation ran the kernel again
    for job, tensors in kept.items():
        for name, tensor in tensors.items():
            assert torch.equal(recomputed[job][name], tensor), (job, name)


def test_an_architecture_without_liger_s_kernels_trains_with_the_fused_loss_alone(spied, monkeypatch):
    monkeypatch.setattr(kernels, "_told", set())
    model = tiny("gemma")
    reference = fused_step(copy.deepcopy(model), ())
    got = fused_step(model, kernels.OPS)
    assert forwards_rebound(model) == []
    assert spied["cross_entropy"] > 0 and spied["liger_rms_norm"] == spied["liger_swiglu"] == 0
    assert_within_rounding(got, reference, model.config)


TRANSFORMS = [LogitTransform(), LogitTransform(softcap=2.0), LogitTransform(divide=4.0),
              LogitTransform(multiply=0.5, softcap=3.0)]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "softcap", "divide", "multiply+softcap"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_the_fused_loss_equals_autograd_in_float64(spied, transform, with_bias):
    rows, hidden_size, chunk = 21, 32, 8
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=generator)
    weight = torch.nn.Parameter(torch.randn(VOCAB, hidden_size, generator=generator) * 0.3, requires_grad=False)
    bias = torch.randn(VOCAB, generator=generator) if with_bias else None
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    token_weights = torch.rand(rows, generator=generator) + 0.5
    use_fused_loss(weight, "liger")

    def exact_logits(h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight.double(), None if bias is None else bias.double())
        logits = logits * transform.multiply / transform.divide
        return logits if transform.softcap is None else transform.softcap * torch.tanh(logits / transform.softcap)

    # the head's dot products, the softmax's sum, the gradient's product with the head, the weighted total
    bound_terms = hidden_size + VOCAB + VOCAB + rows

    def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
        bound = rounding_tolerance(bound_terms, float(expected.detach().abs().max()))
        assert float((got.double() - expected.detach()).abs().max()) <= bound

    fused_input = hidden.clone().requires_grad_(True)
    total, losses = target_cross_entropy(fused_input, weight, bias, targets, token_weights, chunk, transform)
    total.backward()
    exact_input = hidden.double().requires_grad_(True)
    exact = F.cross_entropy(exact_logits(exact_input), targets, reduction="none")
    exact_total = (exact * token_weights.double()).sum()
    exact_total.backward()
    assert spied["cross_entropy"] == -(-rows // chunk)   # one launch per chunk
    assert_close(losses, exact)
    assert_close(total, exact_total)
    assert_close(fused_input.grad, exact_input.grad)

    log_input = hidden.clone().requires_grad_(True)
    log_probs = target_log_probs(log_input, weight, bias, targets, chunk, transform)
    (log_probs * token_weights).sum().backward()
    exact_input.grad = None
    exact_log_probs = -F.cross_entropy(exact_logits(exact_input), targets, reduction="none")
    (exact_log_probs * token_weights.double()).sum().backward()
    assert_close(log_probs, exact_log_probs)
    assert_close(log_input.grad, exact_input.grad)


class _Columns(torch.autograd.Function):
    """A tensor's column blocks as the siblings' stacked output gives them (actors/engine/lora_siblings.py): detached
    views of one (tokens, Σ widths) tensor; the backward joins their gradients as the siblings' does."""

    @staticmethod
    def forward(ctx, x, widths):
        return tuple(part.detach() for part in x.clone().split(widths, dim=1))

    @staticmethod
    def backward(ctx, *grads):
        from actors.engine.lora_siblings import side_by_side

        _Columns.joined = side_by_side(grads)
        return _Columns.joined, None


def _rope_cos_sin(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * inverse[None]
    both = torch.cat([angles, angles], dim=-1)[None]
    return both.cos(), both.sin()


def test_rope_on_columns_of_a_wider_row_is_liger_s_rope_on_copies_bit_for_bit(spied, monkeypatch):
    """q and k as columns of a (tokens, q + k + v) row, rotated where they lie (actors/engine/strided_kernels.py), equal
    Liger's function on contiguous copies, forward and backward, bit for bit (the same kernel on the same numbers), and
    make no copies: Liger's function is not called and the gradients reach the stacked output without a concatenation
    of copies of q and k. A Liger whose RoPE kernel takes other arguments gets its own function."""
    from liger_kernel.transformers.functional import liger_rope

    from actors.engine import strided_kernels

    tokens, q_heads, kv_heads, dim = 11, 4, 2, 8
    widths = [q_heads * dim, kv_heads * dim, kv_heads * dim]
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(tokens, sum(widths), generator=generator)
    upstream = [torch.randn(tokens, width, generator=generator) for width in widths]
    cos, sin = _rope_cos_sin(tokens, dim)

    def run(rotate, columns: bool):
        x = rows.clone().requires_grad_(True)
        q, k, v = _Columns.apply(x, widths) if columns else [part.contiguous() for part in x.split(widths, dim=1)]
        shaped = [t.view(1, tokens, -1, dim).transpose(1, 2) for t in (q, k)]
        q_rot, k_rot = rotate(shaped[0], shaped[1], cos, sin)
        outs = [q_rot.transpose(1, 2).reshape(tokens, -1), k_rot.transpose(1, 2).reshape(tokens, -1), v]
        sum((out * up).sum() for out, up in zip(outs, upstream, strict=True)).backward()
        return [out.detach().clone() for out in outs], x.grad

    before = spied["liger_rope"]
    strided, strided_grad = run(strided_kernels.rope, columns=True)
    assert spied["liger_rope"] == before   # the row-strided launch, not Liger's function
    copied, copied_grad = run(liger_rope, columns=False)
    assert spied["liger_rope"] == before + 1
    for got, expected in zip(strided, copied, strict=True):
        assert torch.equal(got, expected)
    assert torch.equal(strided_grad, copied_grad)
    # a Liger whose kernel takes other arguments: its own function, on copies, the same numbers
    monkeypatch.setattr(strided_kernels, "ROPE_ARGUMENTS", ("q_ptr", "q_row_stride"))
    fallen_back, fallen_back_grad = run(strided_kernels.rope, columns=True)
    assert spied["liger_rope"] == before + 2
    assert all(torch.equal(got, expected) for got, expected in zip(fallen_back, copied, strict=True))
    assert torch.equal(fallen_back_grad, copied_grad)


def test_swiglu_on_columns_of_a_wider_row_is_liger_s_swiglu_bit_for_bit_its_gradients_side_by_side(spied):
    """gate and up as columns of one (tokens, 2 · width) row: the row-strided kernel gives Liger's SwiGLU's output and
    gradients bit for bit (the same float32 arithmetic), within float32's rounding of the torch expression
    (`swiglu_reference`), and writes the gradients into the gate and up columns, so the siblings' backward takes them
    as one tensor, without a copy."""
    from liger_kernel.transformers.functional import liger_swiglu

    from actors.engine import strided_kernels

    tokens, width = 9, 1500   # wider than one program's columns: two column tiles, the second partial
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(tokens, 2 * width, generator=generator) * 3
    upstream = torch.randn(1, tokens, width, generator=generator)

    def run(function, columns: bool):
        x = rows.clone().requires_grad_(True)
        gate, up = _Columns.apply(x, [width, width]) if columns else [p.contiguous() for p in x.split(width, dim=1)]
        out = function(gate.view(1, tokens, width), up.view(1, tokens, width))
        (out * upstream).sum().backward()
        return out.detach().clone(), x.grad

    before = spied["liger_swiglu"]
    strided, strided_grad = run(strided_kernels.swiglu, columns=True)
    assert spied["liger_swiglu"] == before
    joined = _Columns.joined
    copied, copied_grad = run(liger_swiglu, columns=False)
    assert spied["liger_swiglu"] == before + 1
    assert torch.equal(strided, copied) and torch.equal(strided_grad, copied_grad)
    assert joined.stride() == (2 * width, 1)   # the gradients lay side by side in the stacked output's columns
    gate, up = rows.split(width, dim=1)
    reference = strided_kernels.swiglu_reference(gate, up)
    bound = rounding_tolerance(4, float(reference.abs().max()))
    assert float((strided[0] - reference).abs().max()) <= bound
