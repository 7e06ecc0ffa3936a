"""The CUDA LoRA path (actors/engine/lora_cuda.py) in a model and its step, on the CPU: each job's adapter cast whole
once a step (and again after an update), the float32 path (actors/engine/fused_linear.py) kept on a CPU by default,
a whole fused float32 step through the path against the float32 path within the rounding tolerance of its longest
chain of sums (tests/helpers/tolerances.py), the memory prior against what autograd keeps for backward, and when
the grouped_mm kernel is taken (its self-check, aligned layers only). One layer's arithmetic against the exact
arithmetic within bfloat16's bounds: test_lora_cuda_layer.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.engine import fused_linear, lora_cuda, lora_grouped_mm, lora_masters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig
from tests.helpers.fused import first_step_gradients
from tests.helpers.lora_bounds import IN, bf16_values, fused_layer, layout_of


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")


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
    try:
        return first_step_gradients(trainer)
    finally:
        for job in created:
            trainer.remove_job(job.name)


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
    adapter_activations.adapter_bytes(compute_path=True): each layer's input once per input tensor, the rank-r hidden
    and, with dropout, the mask, in the base's dtype."""
    from actors.engine.adapter_activations import adapter_bytes, linear_input_groups
    from actors.engine.adapter_surgery import add_adapter, remove_adapter
    from actors.engine.memory import SavedTensorCounter, _storage_key
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

