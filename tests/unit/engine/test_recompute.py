"""Activation recomputation (`recompute: layers`) against the step without it: the same adapters bit for bit
(CPU float32, dropout on), isolation unchanged (fused == solo), and a jobs file trained through the
in-process driver with it gives the adapters the run without it gives."""

from __future__ import annotations

import pytest
import torch

from actors.engine import lora_grouped
from actors.engine.adapter_surgery import remove_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module, load_base_model
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.config import run_service_config
from actors.service.scheduler.local_run import train_locally
from tests.helpers.fused import VOCAB, job_spec, relative_difference
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data

DROPPING = {"r": 4, "alpha": 8, "dropout": 0.2, "target_modules": "all-linear"}


def _jobs(max_steps: int = 6):
    return [
        (job_spec("a", lora=DROPPING, max_steps=max_steps), random_examples(0, vocab=VOCAB), 0),
        (job_spec("b", lora={"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
                  max_steps=max_steps, lr=1e-2), random_examples(1, vocab=VOCAB, max_len=60), 1),
        (job_spec("c", batch_size=2, max_steps=max_steps), random_examples(2, vocab=VOCAB), 2),
    ]


def _train(base, jobs, recompute: str, step_tokens: int = 100_000) -> tuple[dict, list[float]]:
    trainer = FusedTrainer(base, step_tokens=step_tokens, recompute=recompute)
    handles = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs]
    for job in handles:
        trainer.add_job(job)
    losses = []
    while (report := trainer.train_step()) is not None:
        losses.extend(r.loss for r in report.results)
    weights = {job.name: {k: v.detach().clone() for k, v in job.adapter.named_parameters()} for job in handles}
    for job in handles:
        assert job.step == job.spec.max_steps
        trainer.remove_job(job.name)
    return weights, losses


@pytest.mark.parametrize("arch,grouping", [("llama", "segments"), ("qwen2", "segments"), ("llama", "grouped")])
def test_recomputation_trains_the_same_adapters_bit_for_bit(arch, grouping, monkeypatch):
    """Also with grouped LoRA (the CUDA default), whose layers reading one input share its rows
    (`lora_grouped._input_rows`): the recomputed forward saves what the first one saved."""
    monkeypatch.setattr(lora_grouped, "GROUPING", grouping)
    base = from_module(tiny_model(arch, VOCAB), None)
    plain, plain_losses = _train(base, _jobs(), "none")
    recomputed, recomputed_losses = _train(base, _jobs(), "layers")
    spec, examples, seed = _jobs()[0]
    start = {k: v.detach().clone() for k, v in TrainingJob.create(spec, base, examples, [],
                                                                  seed=seed).adapter.named_parameters()}
    remove_adapter(base.model, "a")
    assert relative_difference(plain["a"], start) > 1e-2, "the adapter did not train"
    assert recomputed_losses == plain_losses
    for name in plain:
        for key in plain[name]:
            assert torch.equal(plain[name][key], recomputed[name][key]), (name, key)


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_recomputation_with_the_cuda_lora_path_trains_the_same_adapters_bit_for_bit(kernel, monkeypatch):
    """The CUDA LoRA path (run here on the CPU, bfloat16): its recomputed forward draws each job's dropout masks
    again from the job's generator as it stood at the layer's entry and reuses the step's compute copies of the
    adapters, so the gradients, and the adapters, are those of the step without recomputation."""
    from actors.engine import lora_cuda

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    base = from_module(tiny_model("llama", VOCAB).to(torch.bfloat16), None)
    plain, plain_losses = _train(base, _jobs(4), "none")
    recomputed, recomputed_losses = _train(base, _jobs(4), "layers")
    assert recomputed_losses == plain_losses
    assert max(float(v.abs().max()) for k, v in plain["a"].items() if "lora_B" in k) > 0, "the adapter did not train"
    for name in plain:
        for key in plain[name]:
            assert torch.equal(plain[name][key], recomputed[name][key]), (name, key)


def test_recomputation_keeps_isolation_with_dropout_and_a_tight_budget():
    base = from_module(tiny_model("llama", VOCAB), None)
    jobs = _jobs()
    fused, _ = _train(base, jobs, "layers", step_tokens=150)
    solo, _ = _train(base, [jobs[0]], "layers", step_tokens=150)
    assert relative_difference(solo["a"], fused["a"]) <= 1e-4


def test_recomputation_lowers_the_allocation_peak():
    """The step's peak of live allocations (torch.profiler's memory events in time order) is far lower with
    recomputation. Six layers: with two, the loss's and one layer's transients are most of either peak."""
    from transformers import LlamaForCausalLM

    from tests.helpers.models import tiny_config
    from tests.helpers.profiling import profiler_peak

    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(tiny_config("llama", VOCAB).__class__(
        **{**tiny_config("llama", VOCAB).to_dict(), "num_hidden_layers": 6})).eval(), None)
    peaks = {}
    for mode in ("none", "layers"):
        trainer = FusedTrainer(base, recompute=mode)
        job = TrainingJob.create(job_spec("a", lora=DROPPING, batch_size=8, max_steps=2, warmup_steps=0), base,
                                 random_examples(0, vocab=VOCAB, min_len=60, max_len=60), [], seed=0)
        trainer.add_job(job)
        trainer.train_step()
        chosen = trainer.compose()
        peaks[mode] = profiler_peak(lambda trainer=trainer, chosen=chosen: trainer.run_step(chosen))
        trainer.remove_job("a")
    assert peaks["layers"] < 0.6 * peaks["none"], peaks


def test_a_layer_s_own_forward_is_back_after_a_recomputed_step():
    """A decoder layer whose forward was rebound on the instance (kernels: liger's fused add-RMSNorm layer) keeps it
    after a step run with recomputation, which rebinds every layer's forward for the step only; a layer without
    one is back to its class's."""
    from actors.engine.recompute import recomputed_layers

    base = from_module(tiny_model("llama", VOCAB), None)
    layers = list(base.decoder.layers)
    own = layers[0].forward = layers[0].forward.__func__.__get__(layers[0])   # an instance forward
    with recomputed_layers(base.decoder, "layers"):
        assert all(type(vars(layer)["forward"]).__name__ == "_RecomputedForward" for layer in layers)
    assert vars(layers[0])["forward"] is own
    assert all("forward" not in vars(layer) for layer in layers[1:])


def test_unknown_recompute_mode_is_refused():
    base = from_module(tiny_model("llama", VOCAB), None)
    with pytest.raises(ValueError, match="recompute must be one of none, layers"):
        FusedTrainer(base, recompute="everything")


def test_the_in_process_driver_trains_the_same_with_recomputation(tiny_model_dirs, tmp_path):
    base_dir = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "task")
    jobs = [job_dict("one", data, 4, lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}),
            job_dict("two", data, 4)]
    base = load_base_model(base_dir, dtype="float32", device="cpu")
    adapters = {}
    for mode in ("none", "layers"):
        spec = run_spec(base_dir, tmp_path / mode, jobs, step_tokens=512).model_copy(update={"recompute": mode})
        assert run_service_config(spec).trainers[0].recompute == mode   # the jobs file's `recompute:`
        summaries = train_locally(spec, base=base, progress=False)
        assert [s.state for s in summaries] == ["completed", "completed"]
        adapters[mode] = {name: adapter_tensors(tmp_path / mode / name) for name in ("one", "two")}
    for name in ("one", "two"):
        for key, tensor in adapters["none"][name].items():
            assert torch.equal(tensor, adapters["layers"][name][key]), (name, key)
