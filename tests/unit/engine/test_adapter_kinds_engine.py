"""The adapter kinds of PEFT's LoraConfig (DoRA, PiSSA / OLoRA, LoRA+) in aspen's engine, against each job's solo
run and aspen's own measurements: every kind fused with plain LoRA jobs trains exactly as alone (the grouped way
too); a checkpoint carries the new tensors; the admission estimate (against PEFT's count of trained parameters) and
the step memory prior (against the saved-tensor hooks) count what the kinds keep; pissa_niter_N is seeded and close
to the full SVD; bad combinations are refused. The kinds against PEFT itself: test_adapter_kinds_peft.py."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from pydantic import ValidationError

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine import lora_grouped
from actors.engine.adapter_surgery import add_adapter, remove_adapter
from actors.engine.job import TrainingJob
from actors.engine.lora_targets import adapted_shapes
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.lora_config import LoraConfig
from actors.spec.run_spec import RunSpec
from tests.helpers.adapter_kinds import VOCAB, job
from tests.helpers.adapter_logits import aspen_logits
from tests.helpers.fused import relative_difference
from tests.helpers.isolation import assert_isolated, train
from tests.helpers.models import random_examples, tiny_model


def mixed_jobs() -> list[tuple[JobSpec, list, int]]:
    specs = [job("dora", {"use_dora": True, "dropout": 0.2}),
             job("pissa", {"init_lora_weights": "pissa", "r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                 batch_size=3),
             job("plus", {"loraplus_lr_ratio": 4.0, "dropout": 0.1}, warmup_steps=1, lr_schedule="linear"),
             job("plain", {"r": 8, "alpha": 16})]
    return [(spec, random_examples(index, count=9, vocab=VOCAB, min_len=5, max_len=30), index)
            for index, spec in enumerate(specs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kind_fused_with_plain_lora_trains_exactly_as_alone(dtype):
    """One fused step at a time for a DoRA job (with dropout), a PiSSA job, a LoRA+ job and a plain job: each
    ends with the weights (magnitudes included) and the losses of its solo run, bit for bit. On a bfloat16
    base (DoRA and PiSSA read its bfloat16 output and weight, in float32; slow on a CPU) the DoRA and PiSSA
    jobs side by side."""
    jobs = mixed_jobs() if dtype == torch.float32 else mixed_jobs()[:2]
    assert_isolated(from_module(tiny_model("llama", VOCAB).to(dtype), None), jobs)


def test_grouped_way_leaves_dora_and_pissa_on_their_own_segments(monkeypatch):
    """With the grouped way forced (CUDA's default), the plain jobs are batched together and the DoRA and
    PiSSA jobs take their own segments: those two stay exactly their solo runs; the plain ones to float32
    rounding (tests/unit/engine/test_fused_training.py)."""
    monkeypatch.setattr(lora_grouped, "GROUPING", "grouped")
    base = from_module(tiny_model("llama", VOCAB), None)
    jobs = mixed_jobs()
    fused, _ = train(base, jobs)
    for spec, examples, seed in jobs:
        solo, _ = train(base, [(spec, examples, seed)])
        if spec.name in ("dora", "pissa"):
            for key, value in solo[spec.name].items():
                assert torch.equal(fused[spec.name][key], value), (spec.name, key)
        else:
            assert relative_difference(solo[spec.name], fused[spec.name]) <= 1e-5, spec.name


def test_a_resumed_dora_pissa_loraplus_job_ends_as_the_uninterrupted_one(tmp_path):
    """The checkpoint carries the magnitudes, the two LoRA+ parameter groups and A0 / B0 (a resumed job whose
    A0 / B0 were zeroed before loading still ends as the uninterrupted one)."""
    base = from_module(tiny_model("llama", VOCAB), None)
    spec = job("resumable", {"use_dora": True, "init_lora_weights": "olora", "loraplus_lr_ratio": 2.0,
                             "dropout": 0.1}, max_steps=4, lr_schedule="cosine", grad_accum=2)
    data = random_examples(0, count=16, vocab=VOCAB)

    def run(job_object: TrainingJob, steps: int | None) -> None:
        trainer = FusedTrainer(base)
        trainer.add_job(job_object)
        taken = 0
        while not job_object.done and (steps is None or taken < steps):
            trainer.train_step()
            taken += 1
        trainer.remove_job(job_object.name)

    uninterrupted = TrainingJob.create(spec, base, data, [], seed=0)
    run(uninterrupted, None)
    expected = adapter_state_dict(uninterrupted.adapter)
    interrupted = TrainingJob.create(spec, base, data, [], seed=0)
    run(interrupted, 3)   # mid-accumulation
    save_checkpoint(interrupted, tmp_path / "ckpt", "tiny")
    resumed = TrainingJob.create(spec, base, data, [], seed=0)
    for _, lora_a0, lora_b0 in resumed.adapter.frozen_initial():
        lora_a0.zero_()
        lora_b0.zero_()
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert [group["lr_ratio"] for group in resumed.optimizer.optimizer.param_groups] == [1.0, 2.0]
    run(resumed, None)
    assert [r.loss for r in resumed.history] == [r.loss for r in uninterrupted.history]
    for key, value in adapter_state_dict(resumed.adapter).items():
        assert torch.equal(value, expected[key]), key


def test_the_admission_estimate_counts_doras_magnitudes_and_pissas_frozen_copies():
    from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER, adapter_memory_bytes

    model = tiny_model("llama", VOCAB)
    output = model.get_output_embeddings()
    shapes = adapted_shapes("all-linear", {name: (m.in_features, m.out_features) for name, m in model.named_modules()
                                           if isinstance(m, torch.nn.Linear) and m is not output})
    peft_model = get_peft_model(copy.deepcopy(model), PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                     use_dora=True))
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter_memory_bytes(4, shapes, dora=True) == BYTES_PER_ADAPTER_PARAMETER * trained
    base = from_module(model, None)
    handle = add_adapter(base.model, "pissa", LoraConfig(r=4, alpha=8, target_modules="all-linear",
                                                         init_lora_weights="pissa"), seed=0)
    frozen = sum(a0.numel() * a0.element_size() + b0.numel() * b0.element_size()
                 for _, a0, b0 in handle.frozen_initial())
    plain = sum(p.numel() for p in handle.parameters()) * BYTES_PER_ADAPTER_PARAMETER
    assert adapter_memory_bytes(4, shapes, frozen_initial=True) == plain + frozen
    remove_adapter(base.model, "pissa")


def test_bad_combinations_are_refused_naming_the_field_and_the_fix():
    job_fields = {"name": "a", "data": "x.jsonl", "format": {"type": "text"}}
    for lora, field in (({"init_lora_weights": "pissa"}, "lora.init_lora_weights"),
                        ({"init_lora_weights": "olora"}, "lora.init_lora_weights")):
        with pytest.raises(ValidationError, match=f"(?s){field}.*set quantization: none"):
            RunSpec(quantization="nf4", jobs=[{**job_fields, "lora": lora}])
        with pytest.raises(ValidationError, match=f"(?s){field}.*set quantization: none"):
            JobSubmission(quantization="int8", job={**job_fields, "lora": lora})
    with pytest.raises(ValidationError, match="(?s)init_lora_weights.*pissa_niter_N"):
        LoraConfig(init_lora_weights="pisa")
    assert LoraConfig(init_lora_weights="pissa_niter_4").init_lora_weights == "pissa_niter_4"
    RunSpec(quantization="nf4", jobs=[{**job_fields, "lora": {"use_dora": True}}])   # QDoRA is accepted
    with pytest.raises(ValidationError, match="loraplus_lr_ratio"):
        LoraConfig(loraplus_lr_ratio=0)
    base = from_module(tiny_model("llama", VOCAB), None)
    with pytest.raises(ValueError, match="lora.r 65 exceeds the rank of a 64x64 layer.*use r <= 64"):
        add_adapter(base.model, "big", LoraConfig(r=65, alpha=8, init_lora_weights="pissa"), seed=0)


def test_pissa_on_a_quantized_base_is_refused_by_the_engine():
    pytest.importorskip("bitsandbytes")
    from actors.engine.models import quantize_linears

    model = tiny_model("llama", VOCAB)
    quantize_linears(model, "nf4", torch.float32, torch.device("cpu"))
    base = from_module(model, None)
    with pytest.raises(ValueError, match="lora.init_lora_weights: 'pissa'.*set quantization: none"):
        add_adapter(base.model, "pissa", LoraConfig(init_lora_weights="pissa"), seed=0)


def test_pissa_niter_is_seeded_and_close_to_the_full_svd():
    """pissa_niter_N: a randomized SVD, its draws seeded by the job (two adapters of one seed agree) and,
    on a weight of exact rank r, the same principal part as the full SVD (sign aside)."""
    base = from_module(tiny_model("llama", VOCAB), None)
    layer = base.model.get_submodule("model.layers.0.self_attn.q_proj")
    with torch.no_grad():
        u, v = torch.randn(64, 4), torch.randn(4, 64)
        layer.weight.copy_(u @ v)
    config = {"r": 4, "alpha": 8, "target_modules": ["model.layers.0.self_attn.q_proj"]}
    first = add_adapter(base.model, "n1", LoraConfig(init_lora_weights="pissa_niter_4", **config), seed=3)
    second = add_adapter(base.model, "n2", LoraConfig(init_lora_weights="pissa_niter_4", **config), seed=3)
    full = add_adapter(base.model, "full", LoraConfig(init_lora_weights="pissa", **config), seed=3)
    name = "model.layers.0.self_attn.q_proj"
    a, b = first.layers[name], second.layers[name]
    assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B, b.lora_B)
    f = full.layers[name]
    torch.testing.assert_close(a.lora_B0 @ a.lora_A0, f.lora_B0 @ f.lora_A0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.scaling * a.lora_B0 @ a.lora_A0, layer.weight, rtol=1e-4, atol=1e-4)


def test_the_step_memory_prior_counts_what_dora_keeps_for_backward():
    """What autograd keeps for a DoRA adapter beyond a plain one (counted by the saved-tensor hooks the
    trainer's CPU meter uses) against adapter_activations.adapter_bytes' two (out) rows per token and layer; PiSSA's
    frozen product keeps nothing per token."""
    from actors.engine.adapter_activations import adapter_bytes
    from actors.engine.memory import SavedTensorCounter, _storage_key

    base = from_module(tiny_model("llama", VOCAB), None)
    output = base.model.get_output_embeddings()
    shapes = {name: (m.in_features, m.out_features) for name, m in base.model.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not output}
    tokens = 200
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    measured, analytic = {}, {}
    for kind, fields in (("plain", {}), ("dora", {"use_dora": True}), ("pissa", {"init_lora_weights": "pissa"})):
        config = LoraConfig(r=4, alpha=8, target_modules="all-linear", **fields)
        add_adapter(base.model, kind, config, seed=0)
        counter = SavedTensorCounter(exclude={_storage_key(t)[0] for t in [*base.model.parameters(),
                                                                            *base.model.buffers()]})
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            aspen_logits(base.model, kind, ids)
        measured[kind] = counter.saved_bytes
        analytic[kind] = adapter_bytes([(config, list(shapes), tokens)], shapes, {}, torch.float32)
        remove_adapter(base.model, kind)
    transient = 3 * max(i * o for i, o in shapes.values()) * 4   # the norm's W + BA, counted once
    dora_extra = measured["dora"] - measured["plain"]
    assert dora_extra > 0
    assert abs((analytic["dora"] - transient - analytic["plain"]) - dora_extra) <= 0.02 * dora_extra
    assert measured["pissa"] == measured["plain"] and analytic["pissa"] == analytic["plain"]
