"""The CUDA LoRA path (actors/engine/lora_cuda.py) run on the CPU in bfloat16, both of its kernels, against the
exact arithmetic (float64 from the same bfloat16-valued inputs and float32 masters) within bounds derived from
bfloat16's rounding, and against the float32 path (actors/engine/fused_linear.py) that the CPU keeps.

The bounds, elementwise (u = 2^-8, bfloat16's unit roundoff; |M| the entrywise absolute value; products of the
inputs are exact in float32 and every sum is accumulated in float32, whose error γ_n·|.| with γ_n = n·2^-24 is
added for the n terms of each sum):
- forward: the base product rounded once (u |x||W|^T), A and s·B rounded once each when cast, the down
  projection once, the accumulated update and the output once: 2u |x||W|^T + 4u s |x||A|^T|B|^T;
- the gradient of A: s·B cast (u), (g sB) rounded (u), its product with x rounded (u): 3u s (|g||B|)^T |x|;
  of B: A cast, x A^T rounded, g^T (x A^T) rounded: 3u s |g|^T (|x||A|^T);
- the gradient of x: g W rounded (u), then (g sB) A added and rounded: 2u |g||W| + 4u s |g||B||A|."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.engine import fused_linear, lora_cuda, lora_grouped_mm, lora_layer_state, lora_masters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig
from tests.helpers.lora_bounds import (
    BOUNDS,
    F32,
    IN,
    OUT,
    RANKS,
    U,
    assert_within,
    bf16_values,
    exact,
    fused_layer,
    layout_of,
    run_layer,
)


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_forward_and_gradients_within_the_bfloat16_bounds_of_the_exact_arithmetic(monkeypatch, kernel):
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    assert out.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for a in layer.adapters.values() for p in (a.lora_A, a.lora_B))
    expected, out_bound, grad_x_exact, grad_x_bound, grads, grad_bounds = exact(layer, x, upstream)
    assert_within(out[0], expected, out_bound, "output")
    assert_within(grad_x[0], grad_x_exact, grad_x_bound, "input gradient")
    for adapter, (grad_a, grad_b), (bound_a, bound_b) in zip(layer.adapters.values(), grads, grad_bounds, strict=True):
        assert_within(adapter.lora_A.grad, grad_a, bound_a, "A's gradient")
        assert_within(adapter.lora_B.grad, grad_b, bound_b, "B's gradient")


def test_the_bounds_catch_a_wrong_update(monkeypatch):
    """The bound is tight enough to fail a real mistake: an update with the scaling applied twice."""
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    adapter = layer.adapters["job1"]
    original = lora_layer_state.compute_weights

    def doubled(layout, adapters, dtype):
        weights = original(layout, adapters, dtype)
        return [(a, b * adapter.scaling) if ad is adapter else (a, b)
                for ad, (a, b) in zip(adapters, weights, strict=True)]

    monkeypatch.setattr(lora_layer_state, "compute_weights", doubled)
    monkeypatch.setattr(lora_cuda, "KERNEL", "segments")
    out, _ = run_layer(layer, x, upstream, layout_of())
    expected, out_bound, *_ = exact(layer, x, upstream)
    assert not bool(((out[0].double() - expected).abs() <= out_bound).all())


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_equals_the_float32_path_within_the_bound(monkeypatch, kernel):
    """The float32 path (today's CPU path, float32 adapters on a float32 copy of the layer) on the same
    bfloat16-valued inputs: its own error is float32 rounding only, so the bfloat16 bound covers both."""
    layer16 = fused_layer()
    layer32 = fused_layer(torch.float32)
    with torch.no_grad():
        layer32.base.weight.copy_(layer16.base.weight.float())
        for a16, a32 in zip(layer16.adapters.values(), layer32.adapters.values(), strict=True):
            a32.lora_B.copy_(a16.lora_B)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    out16, grad16 = run_layer(layer16, x, upstream, layout_of())
    monkeypatch.setattr(lora_cuda, "COMPUTE", "float32")
    out32, grad32 = run_layer(layer32, x.float(), upstream.float(), layout_of())
    _, out_bound, _, grad_x_bound, _, grad_bounds = exact(layer16, x, upstream)
    assert_within(out16[0], out32[0].double(), out_bound * 1.01, "output against the float32 path")
    assert_within(grad16[0], grad32[0].double(), grad_x_bound * 1.01, "input gradient against the float32 path")
    for a16, a32, (bound_a, bound_b) in zip(layer16.adapters.values(), layer32.adapters.values(), grad_bounds,
                                            strict=True):
        assert_within(a16.lora_A.grad, a32.lora_A.grad.double(), bound_a * 1.01, "A's gradient, float32 path")
        assert_within(a16.lora_B.grad, a32.lora_B.grad.double(), bound_b * 1.01, "B's gradient, float32 path")


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_job_alone_equals_the_same_job_fused(monkeypatch, kernel):
    """Isolation: a job's output rows and gradients are its own segment's arithmetic, the same bit for bit
    whether other jobs share the layer (or the row order of the stream) or not."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    fused = {name: (a.lora_A.grad.clone(), a.lora_B.grad.clone()) for name, a in layer.adapters.items()}
    for index, (start, end) in enumerate(BOUNDS):
        name = f"job{index}"
        alone_out, alone_grad_x = run_layer(layer, x[:, start:end], upstream[:, start:end],
                                       layout_of(((0, end - start),), [name]))
        assert torch.equal(alone_out[0], out[0, start:end])
        assert torch.equal(alone_grad_x[0], grad_x[0, start:end])
        adapter = layer.adapters[name]
        assert torch.equal(adapter.lora_A.grad, fused[name][0]) and torch.equal(adapter.lora_B.grad, fused[name][1])


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_nan_in_one_job_reaches_no_other_job(monkeypatch, kernel):
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    run_layer(layer, x, upstream, layout_of())
    clean = {name: (a.lora_A.grad.clone(), a.lora_B.grad.clone()) for name, a in layer.adapters.items()}
    poisoned_x, poisoned_g = x.clone(), upstream.clone()
    poisoned_x[0, 13, 5] = float("nan")
    poisoned_g[0, 20, 3] = float("inf")
    out, grad_x = run_layer(layer, poisoned_x, poisoned_g, layout_of())
    assert not bool(out[0, 11:40].isfinite().all())
    for name in ("job0", "job2"):
        adapter = layer.adapters[name]
        assert torch.equal(adapter.lora_A.grad, clean[name][0]) and torch.equal(adapter.lora_B.grad, clean[name][1])
    assert bool(out[0, :11].isfinite().all()) and bool(out[0, 40:].isfinite().all())
    assert bool(grad_x[0, :11].isfinite().all()) and bool(grad_x[0, 40:].isfinite().all())


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_tokens_of_no_adapter_get_the_base_output_only(monkeypatch, kernel):
    """A job without an adapter on this layer (and the rows after the last segment): the base's product alone,
    as the exact arithmetic rounds it once; its rows' input gradient has no LoRA term."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer(ranks=RANKS[:2])
    bounds = ((0, 11), (11, 30), (30, 45), (45, 57))
    layout = StepLayout((("job0", 0, 11), ("other", 11, 30), ("job1", 30, 45), ("other2", 45, 57)),
                        tuple(bounds), 57)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout)
    base_only = layer.base(x)
    assert torch.equal(out[0, 11:30], base_only[0, 11:30]) and torch.equal(out[0, 45:], base_only[0, 45:])
    assert torch.equal(grad_x[0, 11:30], (upstream[0, 11:30] @ layer.base.weight))


def test_dropout_masks_come_from_each_jobs_generator_and_backward_uses_them():
    layer = fused_layer(ranks=(4, 8))
    drop = layer.adapters["job0"]
    drop.dropout = 0.25
    drop.dropout_generator = torch.Generator().manual_seed(7)
    layer.adapters.train(True)
    x, upstream = bf16_values(1, 40, IN), bf16_values(1, 40, OUT)
    replay = torch.Generator().set_state(drop.dropout_generator.get_state())
    mask = torch.empty(11, IN, dtype=torch.bfloat16).bernoulli_(0.75, generator=replay)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    out, grad_x = run_layer(layer, x, upstream, layout_of(((0, 11), (11, 40))))
    # the reference: the same job with its input's dropped entries zeroed and the rest scaled by 1/keep, exactly
    dropped = (x[0, :11].double() * mask.double()) / 0.75
    a, b, s = drop.lora_A.double(), drop.lora_B.double(), drop.scaling
    expected = x[0, :11].double() @ layer.base.weight.double().t() + s * (dropped @ a.t()) @ b.t()
    magnitude = x[0, :11].double().abs() @ layer.base.weight.double().abs().t()
    lora_magnitude = s * (dropped.abs() @ a.abs().t()) @ b.abs().t()
    assert_within(out[0, :11], expected, (2 * U + IN * F32) * magnitude + (5 * U + 2 * IN * F32) * lora_magnitude,
            "output with dropout")
    g = upstream[0, :11].double()
    expected_grad_a = s * (g @ b).t() @ dropped
    bound_a = (3 * U + 64 * F32) * s * (g.abs() @ b.abs()).t() @ dropped.abs()
    assert_within(drop.lora_A.grad, expected_grad_a, bound_a, "A's gradient with dropout")
    expected_grad_x = g @ layer.base.weight.double() + s * ((g @ b) @ a) * mask.double() / 0.75
    bound_x = ((2 * U + OUT * F32) * (g.abs() @ layer.base.weight.double().abs())
               + (5 * U + 2 * OUT * F32) * s * ((g.abs() @ b.abs()) @ a.abs()) * mask.double() / 0.75)
    assert_within(grad_x[0, :11], expected_grad_x, bound_x, "input gradient with dropout")


def test_each_jobs_adapter_is_cast_whole_once_a_step_and_again_after_an_update(monkeypatch):
    """Every job's A and B are views of one flat float32 tensor (`adapter_surgery.pool_masters`): the path casts
    it once a step for all of the job's layers (its As copied, its Bs times the scaling, in two operations; a
    recomputed forward of the same step casts nothing), again after its weights changed in place, and again in a
    new step; each layer's copies are views of that cast."""
    from actors.engine.adapter_surgery import add_adapter
    from actors.engine.models import from_module
    from tests.helpers.models import tiny_model

    base = from_module(tiny_model("llama", 300).to(torch.bfloat16), None)
    handles = [add_adapter(base.model, f"job{index}", LoraConfig(r=8, alpha=16, target_modules="all-linear"),
                           seed=index) for index in range(2)]
    pools = {next(iter(h.layers.values())).master_pool[0].flat.data_ptr(): h.name for h in handles}
    assert all(layer.master_pool[0] is next(iter(h.layers.values())).master_pool[0]
               for h in handles for layer in h.layers.values())
    casts: list[str] = []
    original = torch.Tensor.copy_

    def counting(self, source, *args, **kwargs):
        if source.data_ptr() in pools and source.dim() == 1:   # a whole pool's As (a layer's own view is 2-d)
            casts.append(pools[source.data_ptr()])
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    layout = layout_of(((0, 12), (12, 30)), ["job0", "job1"])

    def forward():
        with step_layout(layout):
            return base.decoder(input_ids=ids, position_ids=torch.arange(30)[None], use_cache=False).last_hidden_state

    forward()
    forward()                        # a recomputed forward of the same step: no new cast
    assert sorted(casts) == ["job0", "job1"]
    first = handles[1].layers["model.layers.0.self_attn.q_proj"]
    with torch.no_grad():
        first.lora_B.add_(1.0)       # its job's weights changed in place (as a load does)
    forward()
    assert sorted(casts) == ["job0", "job1", "job1"]
    layout = layout_of(((0, 12), (12, 30)), ["job0", "job1"])   # a new step
    forward()
    assert sorted(casts) == ["job0", "job0", "job1", "job1", "job1"]
    [(lora_a, lora_b)] = lora_masters.compute_weights(layout, [first], torch.bfloat16)
    assert torch.equal(lora_a, first.lora_A.detach().to(torch.bfloat16))
    assert torch.equal(lora_b, (first.lora_B.detach() * first.scaling).to(torch.bfloat16))


def test_the_float32_path_stays_on_a_cpu_by_default(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "auto")
    called = []
    monkeypatch.setattr(lora_cuda, "linear_with_adapters", lambda *args: called.append(1))
    layer = fused_layer()
    with step_layout(layout_of()):
        layer(bf16_values(1, 57, IN))
    assert not called
    assert fused_linear.FusedLoraLinear is FusedLoraLinear


def _step_gradients(base, jobs) -> dict[tuple[str, str], torch.Tensor]:
    """One fused step's adapter gradients (before the optimizers divide and step them)."""
    from actors.engine import trainer as trainer_module
    from actors.engine.job import TrainingJob

    trainer = trainer_module.FusedTrainer(base, step_tokens=100_000)
    created = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs]
    for job in created:
        trainer.add_job(job)
        with torch.no_grad():   # B away from its zero start, so that every gradient is exercised
            for name, parameter in job.adapter.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    captured: dict[tuple[str, str], torch.Tensor] = {}
    original = trainer_module.step_jobs

    def capture(optimizers, targets, **options):
        for job in created:
            captured.update({(job.name, n): p.grad.clone() for n, p in job.adapter.named_parameters()})
        return original(optimizers, targets, **options)

    trainer_module.step_jobs = capture
    try:
        trainer.run_step(trainer.compose())
    finally:
        trainer_module.step_jobs = original
        for job in created:
            trainer.remove_job(job.name)
    return captured


def test_a_fused_float32_step_through_the_path_equals_the_float32_path_within_rounding(monkeypatch):
    """A whole fused step of a tiny Llama in float32, three jobs (ranks, targets, a job with dropout): the path's
    gradients against the float32 path's, which computes the same sums in another order (its grouping of the
    update, F.linear(F.linear(x, A), B) * s against x A^T added by (sB)), so within the rounding tolerance of
    the step's longest chain of sums (tests/helpers/tolerances.py)."""
    from actors.engine.models import from_module
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.models import random_examples, tiny_model
    from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

    model = tiny_model("llama", VOCAB)
    base = from_module(model, None)
    jobs = [(job_spec("a", lora={"r": 4, "alpha": 8, "dropout": 0.2, "target_modules": "all-linear"}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1),
            (job_spec("c", batch_size=2), random_examples(2, vocab=VOCAB), 2)]
    path = _step_gradients(base, jobs)
    monkeypatch.setattr(lora_cuda, "COMPUTE", "float32")
    reference = _step_gradients(base, jobs)
    assert path.keys() == reference.keys()
    longest = max(len(e) for _, examples, _ in jobs for e in examples)
    terms = llama_chain_terms(model.config, sequence=longest, tokens=3 * longest)
    for key, expected in reference.items():
        magnitude = float(expected.abs().max())
        assert magnitude > 0, key
        difference = float((path[key] - expected).abs().max())
        assert difference <= rounding_tolerance(terms, magnitude), (key, difference, magnitude)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_memory_prior_counts_what_the_path_keeps_for_backward(dtype):
    """What autograd keeps for two jobs' adapters on the path (counted by the saved-tensor hooks the trainer's
    CPU meter uses, the base's own saved tensors taken out by a step with no adapter) against
    memory_prior.adapter_bytes(compute_path=True): each layer's input once per input tensor, the rank-r hidden
    and, with dropout, the mask, in the base's dtype."""
    from actors.engine.adapter_surgery import add_adapter, remove_adapter
    from actors.engine.memory import SavedTensorCounter, _storage_key
    from actors.engine.memory_prior import adapter_bytes, linear_input_groups
    from actors.engine.models import from_module
    from tests.helpers.models import tiny_model

    base = from_module(tiny_model("llama", 300).to(dtype), None)
    model = base.model
    output = model.get_output_embeddings()
    shapes = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and m is not output}
    configs = {"plain": LoraConfig(r=4, alpha=8, target_modules="all-linear"),
               "dropping": LoraConfig(r=8, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])}
    bounds = {"plain": (0, 70), "dropping": (70, 130)}
    ids = torch.randint(3, 300, (1, 130), generator=torch.Generator().manual_seed(0))
    layout = StepLayout(tuple((name, *bounds[name]) for name in configs), ((0, 40), (40, 70), (70, 130)), 130)

    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)   # the base's own activations
                                                                                   # kept with or without adapters

    def saved() -> int:
        counter = SavedTensorCounter(exclude={_storage_key(t)[0] for t in [*model.parameters(), *model.buffers(),
                                                                            embeddings]})
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), step_layout(layout):
            model.model(inputs_embeds=embeddings, position_ids=torch.arange(130)[None], use_cache=False)
        return counter.saved_bytes

    without = saved()
    for index, (name, config) in enumerate(configs.items()):
        add_adapter(model, name, config, seed=index)
    model.train(False)
    for module in model.modules():
        if isinstance(module, FusedLoraLinear):
            module.adapters.train(True)
    def forward():   # as the trainer's probe sees them: inside a step, every input kept (no storage reused)
        with step_layout(layout):
            return model.model(inputs_embeds=embeddings, position_ids=torch.arange(130)[None], use_cache=False)

    groups = linear_input_groups(model, forward)
    measured = saved() - without
    from actors.engine.lora_targets import match_targets
    jobs = [(config, match_targets(list(shapes), config.target_modules), bounds[name][1] - bounds[name][0])
            for name, config in configs.items()]
    analytic = adapter_bytes(jobs, shapes, groups, dtype, compute_path=True)
    for name in configs:
        remove_adapter(model, name)
    assert measured > 0
    assert analytic == measured, (analytic, measured)


def test_the_grouped_mm_self_check_passes_a_correct_kernel_and_refuses_a_wrong_or_failing_one(monkeypatch, caplog):
    """The check run once per device before `auto` takes grouped_mm: torch's kernel here passes; one that is
    off by more than a bfloat16 rounding in a single entry of the jagged-sum form, or that raises, is refused
    with a warning naming the device (and the layers then take segments)."""
    device = torch.device("cpu")
    assert lora_grouped_mm._check_grouped_mm(device)
    original = torch._grouped_mm

    def off_in_one_form(left, right, offs):
        out = original(left, right, offs=offs)
        if left.dim() == 2 and right.dim() == 2:   # the jagged-K form only
            out = out.clone()
            out[2, 0, 0] = out[2, 0, 0] * 1.05 + 0.5
        return out

    monkeypatch.setattr(torch, "_grouped_mm", off_in_one_form)
    assert not lora_grouped_mm._check_grouped_mm(device)
    assert "disagrees" in caplog.text and "cpu" in caplog.text

    def failing(*args, **kwargs):
        raise RuntimeError("expected data_ptr to be aligned to 16 bytes")

    monkeypatch.setattr(torch, "_grouped_mm", failing)
    assert not lora_grouped_mm._check_grouped_mm(device)
    assert "not usable" in caplog.text
    monkeypatch.setattr(lora_grouped_mm, "_GROUPED_CHECKED", {})
    assert not lora_grouped_mm.grouped_mm_works(device)


def test_grouped_mm_is_not_taken_for_an_unaligned_layer(monkeypatch):
    """A layer whose widths are not multiples of 8 (rows not 16-byte aligned for the kernel's loads) takes the
    per-segment kernel even when grouped_mm is asked for."""
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    base = nn.Linear(20, 12).to(torch.bfloat16).requires_grad_(False)
    layer = FusedLoraLinear(base)
    for index in range(2):
        layer.adapters[f"job{index}"] = LoraAdapter(20, 12, LoraConfig(r=4, alpha=8),
                                                    generator=torch.Generator().manual_seed(index),
                                                    device=torch.device("cpu"))
    with step_layout(layout_of(((0, 5), (5, 9)))):
        layer(bf16_values(1, 9, 20))
    assert not calls


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_biased_base_within_the_bounds_plus_the_bias_rounding(monkeypatch, kernel):
    """A base with a bias (Qwen2's q, k, v): the grouped kernel adds it to the jobs' update before the base product
    is accumulated into it, so the output is the exact x W^T + b + updates within the bias-free bound plus the
    bias's own roundings (added to the update, then in the output: 2u |b|, doubled for the sums it joins)."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer(bias=True)
    with torch.no_grad():
        layer.base.bias.copy_(bf16_values(OUT) * 4)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    expected, out_bound, grad_x_exact, grad_x_bound, *_ = exact(layer, x, upstream)
    bias = layer.base.bias.double()
    assert_within(out[0], expected + bias, out_bound + 4 * U * bias.abs(), "output with a bias")
    assert_within(grad_x[0], grad_x_exact, grad_x_bound, "input gradient with a bias")
    assert not bool(((out[0].double() - expected).abs() <= out_bound).all())   # the bias is really there
