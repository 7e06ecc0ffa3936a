"""The GPU fast path on CUDA (skipped without it): the CUDA LoRA path's two kernels against the exact arithmetic
within the bfloat16 bounds the CPU tests derive (tests/helpers/lora_bounds.py), grouped_mm's self-check passing
on the device, and a fused step that never makes the host wait before its one read-back (CUDA's own sync
debug mode raises on any synchronising call), with the same losses as the float32 path to rounding, and Tinker
calls sharing a step of jobs ending as apart, to rounding."""

from __future__ import annotations

import pytest
import torch

from actors.engine import lora_cuda, lora_grouped_mm
from actors.engine import trainer as trainer_module
from tests.helpers.lora_bounds import (
    BOUNDS,
    IN,
    OUT,
    assert_layer_within,
    bf16_values,
    fused_layer,
    layout_of,
    run_layer,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_the_cuda_path_is_within_the_bfloat16_bounds_on_the_gpu(monkeypatch, kernel):
    if kernel == "grouped_mm" and not lora_grouped_mm.grouped_mm_works(torch.device("cuda")):
        pytest.skip("torch._grouped_mm does not work on this GPU (logged); the path takes segments here")
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer(device="cuda")
    x, upstream = bf16_values(1, 57, IN).cuda(), bf16_values(1, 57, OUT).cuda()
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    assert bool(calls) == (kernel == "grouped_mm")
    assert_layer_within(layer, x, upstream, out, grad_x, BOUNDS)


def test_grouped_mm_is_what_auto_takes_on_a_hopper_gpu():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's kernel is for sm90 and newer")
    assert lora_grouped_mm.grouped_mm_works(torch.device("cuda"))


def test_layers_sharing_an_input_are_computed_together_within_the_bounds_on_the_gpu(monkeypatch):
    """On a Hopper GPU `auto` computes q, k and v together (actors/engine/lora_siblings.py: grouped_mm takes the
    views it gives it, by its once-a-device check), within the bounds of the exact arithmetic, in one forward call."""
    from actors.engine import lora_siblings
    from tests.helpers.sibling_layers import assert_within_the_bounds, attention, inputs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's kernel is for sm90 and newer")
    assert lora_siblings.views_work(torch.device("cuda"))
    together = []
    real = lora_siblings._SiblingLinears.apply
    monkeypatch.setattr(lora_siblings._SiblingLinears, "apply", lambda *a: together.append(1) or real(*a))
    x, upstream = inputs("cuda")
    assert_within_the_bounds(attention(device="cuda"), x, upstream)
    assert together == [1]


def _three_job_trainer(dtype: torch.dtype, device: str = "cuda"):
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.models import random_examples, tiny_model

    base = from_module(tiny_model("llama", VOCAB).to(device, dtype), None)
    trainer = trainer_module.FusedTrainer(base, step_tokens=100_000)
    for index, lora in enumerate(({"r": 8, "alpha": 16, "target_modules": "all-linear"},
                                  {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"},
                                  {"r": 16, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})):
        trainer.add_job(TrainingJob.create(job_spec(f"job-{index}", lora=lora, max_grad_norm=1.0), base,
                                           random_examples(index, vocab=VOCAB), [], seed=index))
    return trainer


def test_a_fused_step_never_waits_for_the_gpu_before_its_read_back(monkeypatch):
    """CUDA's sync debug mode set to error for the whole step but its one read-back (`_read_back`): a blocking
    copy, an .item(), a .tolist() or a synchronize inside the step raises. The second step is the one checked
    (the first builds the optimizers' state), and the step after it too (its batch packed during the last)."""
    trainer = _three_job_trainer(torch.bfloat16)
    trainer.train_step()
    original = trainer_module._read_back

    def read_back(*args):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(*args)
        finally:
            torch.cuda.set_sync_debug_mode(2)

    monkeypatch.setattr(trainer_module, "_read_back", read_back)
    for _ in range(2):
        chosen = trainer.compose()
        torch.cuda.set_sync_debug_mode(2)
        try:
            report = trainer.run_step(chosen)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert report.results and all(r.loss > 0 for r in report.results)


def test_the_cuda_path_computes_the_float32_paths_losses_on_the_gpu(monkeypatch):
    """A first fused step of three jobs in float32 on the GPU (B made non-zero: the adapters take part): through
    the path (per segment) and through the float32 path the jobs' losses agree within the rounding tolerance of
    the model's longest chain of sums (tests/helpers/tolerances.py). Only the first step: AdamW's first update
    magnifies a rounding difference near a zero gradient up to 2 lr, so later losses are no test of the path."""
    from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

    losses = {}
    for compute in ("auto", "float32"):
        monkeypatch.setattr(lora_cuda, "COMPUTE", compute)
        trainer = _three_job_trainer(torch.float32)
        with torch.no_grad():
            for job in trainer.jobs.values():
                for name, parameter in job.adapter.named_parameters():
                    if "lora_B" in name:
                        parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
        losses[compute] = [r.loss for r in trainer.train_step().results]
    config = trainer.base.model.config
    terms = llama_chain_terms(config, sequence=64, tokens=200, backward=False)
    for got, expected in zip(losses["auto"], losses["float32"], strict=True):
        assert abs(got - expected) <= rounding_tolerance(terms, abs(expected)), (got, expected)


def calls_in_a_step_against_apart(device: str) -> None:
    """Tinker calls sharing a fused step of three jobs on `device` in float32, against the same step without them
    and the calls' own pass: every job's loss and every call's summed loss within the rounding tolerance of the
    model's longest chain of sums (on CUDA a GEMM over a longer stream may take another algorithm: equal on the
    CPU, to rounding here)."""
    from actors.engine.interactive_step import FusedCalls, ModelCall, check_call, run_calls
    from tests.helpers.interactive import datum, random_b_model
    from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

    def setup():
        torch.manual_seed(0)
        trainer = _three_job_trainer(torch.float32, device)
        models = [random_b_model(trainer.base, "alice-0", 4, 1), random_b_model(trainer.base, "bob-0", 8, 2)]
        vocab = int(trainer.base.lm_head.weight.shape[0])
        calls = [ModelCall("alice-0", (datum(1, 7, vocab=vocab), datum(2, 19, vocab=vocab))),
                 ModelCall("bob-0", (datum(3, 11, rl=True, vocab=vocab), datum(4, 5, rl=True, vocab=vocab)),
                           "importance_sampling")]
        return trainer, models, calls

    trainer, _, _ = setup()
    alone = [r.loss for r in trainer.run_step(trainer.compose()).results]
    trainer, _, calls = setup()
    apart = [output.loss_sum for output in run_calls(trainer.base, calls, backward=True)]
    trainer, _, calls = setup()
    checked = FusedCalls(calls, [check_call(call, int(trainer.base.lm_head.weight.shape[0]), 1 << 20)
                                 for call in calls])
    fused = trainer.run_step(trainer.compose(), calls=checked)
    terms = llama_chain_terms(trainer.base.model.config, sequence=64, tokens=300, backward=False)
    for got, expected in [*zip([r.loss for r in fused.results], alone, strict=True),
                          *zip([output.loss_sum for output in fused.call_outputs], apart, strict=True)]:
        assert abs(got - expected) <= rounding_tolerance(terms, abs(expected)), (got, expected)


def test_tinker_calls_in_a_jobs_step_end_as_apart_on_the_gpu():
    calls_in_a_step_against_apart("cuda")
