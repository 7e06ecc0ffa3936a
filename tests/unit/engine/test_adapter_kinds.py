"""The adapter kinds of PEFT's LoraConfig against PEFT 0.21 itself (the independent reference): DoRA
(`use_dora`), PiSSA / OLoRA (`init_lora_weights`) and LoRA+ (`loraplus_lr_ratio`, PEFT's
create_loraplus_optimizer). Same initialisation, same forward, same gradients; PEFT loads the exported folder
onto the unmodified base and computes the same logits; LoRA+ takes PEFT's updates; every kind fused with plain
LoRA jobs trains exactly as alone; a checkpoint carries the new tensors; bad combinations are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.optimizers import create_loraplus_optimizer
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.checkpoint.peft_io import CONFIG_NAME, WEIGHTS_NAME, adapter_state_dict, load_adapter_weights, save_adapter
from actors.engine import lora_grouped
from actors.engine.adapter_surgery import add_adapter, remove_adapter, set_adapters_training
from actors.engine.job import TrainingJob
from actors.engine.lora_targets import adapted_shapes
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.lora_config import LoraConfig
from actors.spec.run_spec import RunSpec
from tests.helpers.accumulation import FixedOrder, pad_rows
from tests.helpers.adapter_logits import SameMask, aspen_logits
from tests.helpers.fused import relative_difference
from tests.helpers.isolation import assert_isolated, train
from tests.helpers.models import random_examples, tiny_config, tiny_model

VOCAB = 300
# aspen's LoraConfig fields -> PEFT's, per kind
KINDS = {
    "dora": ({"use_dora": True}, {"use_dora": True}),
    "pissa": ({"init_lora_weights": "pissa"}, {"init_lora_weights": "pissa"}),
    "olora": ({"init_lora_weights": "olora"}, {"init_lora_weights": "olora"}),
    "dora+pissa": ({"use_dora": True, "init_lora_weights": "pissa"}, {"use_dora": True, "init_lora_weights": "pissa"}),
    "dora+dropout": ({"use_dora": True, "dropout": 0.3}, {"use_dora": True, "lora_dropout": 0.3}),
    "pissa+dropout": ({"init_lora_weights": "pissa", "dropout": 0.3},
                      {"init_lora_weights": "pissa", "lora_dropout": 0.3}),
}


def peft_key(name: str) -> str:
    """PEFT's parameter name for one of AdapterHandle.named_parameters()'s."""
    if name.endswith(".lora_magnitude_vector"):
        return f"base_model.model.{name}.default.weight"
    return "base_model.model." + name.replace(".weight", ".default.weight")


@pytest.mark.parametrize("kind,arch", [(kind, "llama") for kind in KINDS] + [("dora", "qwen2")])
def test_each_kind_matches_peft_init_forward_and_gradients(kind, arch):
    """Qwen2's attention projections have a bias, which DoRA's rescaling leaves out (as PEFT)."""
    ours, theirs = KINDS[kind]
    reference = tiny_model(arch, VOCAB)
    base = from_module(copy.deepcopy(reference), None)
    handle = add_adapter(base.model, "job", LoraConfig(r=4, alpha=8, target_modules="all-linear", **ours), seed=0)
    peft_model = get_peft_model(copy.deepcopy(reference),
                                PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **theirs))
    peft_params = dict(peft_model.named_parameters())
    # the same initialisation where it is deterministic: PiSSA / OLoRA's A and B, DoRA's magnitudes
    for name, param in handle.named_parameters():
        if "init_lora_weights" in ours or "magnitude" in name:
            torch.testing.assert_close(param, peft_params[peft_key(name)], rtol=1e-5, atol=1e-6)
    # moved away from the initialisation (B != 0, magnitudes off the norms), then the same weights in both
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in handle.named_parameters():
            if "lora_A" not in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
            peft_params[peft_key(name)].copy_(param)
    ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    if "dropout" in ours:
        set_adapters_training(base.model, True)
        peft_model.train()
        mask_generator = torch.Generator().manual_seed(0)
        mask_generator.set_state(handle.dropout_generator.get_state())
        for module in peft_model.modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                module.lora_dropout["default"] = SameMask(ours["dropout"], mask_generator)
    else:
        set_adapters_training(base.model, False)
        peft_model.eval()
    logits, peft_logits = aspen_logits(base.model, "job", ids), peft_model(input_ids=ids).logits
    logits.square().mean().backward()
    peft_logits.square().mean().backward()
    assert (logits - peft_logits).abs().max() <= 2e-6
    for name, param in handle.named_parameters():
        peft_grad = peft_params[peft_key(name)].grad
        scale = float(peft_grad.abs().max())
        assert scale > 0, name
        assert float((param.grad - peft_grad).abs().max()) <= 1e-5 * scale, name
    # the kind changes the result: plain LoRA with the same A and B computes other logits
    plain = from_module(copy.deepcopy(reference), None)
    plain_handle = add_adapter(plain.model, "job", LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    with torch.no_grad():
        trained = dict(handle.named_parameters())
        for name, param in plain_handle.named_parameters():
            param.copy_(trained[name])
        set_adapters_training(plain.model, False)
        assert (aspen_logits(plain.model, "job", ids) - peft_logits).abs().max() > 1e-3


def job(name: str, lora: dict, **fields) -> JobSpec:
    settings = {"data": "unused.jsonl", "format": {"type": "text"}, "batch_size": 2, "max_steps": 3, "lr": 1e-2,
                "lr_schedule": "constant", **fields}
    return JobSpec(name=name, lora={"r": 4, "alpha": 8, "target_modules": "all-linear", **lora}, **settings)


@pytest.mark.parametrize("kind", ["dora", "pissa", "olora", "dora+pissa"])
def test_peft_loads_the_export_on_the_unmodified_base(kind, tmp_path):
    reference = tiny_model("llama", VOCAB)
    base = from_module(copy.deepcopy(reference), None)
    trainer = FusedTrainer(base)
    trained = TrainingJob.create(job("kind", KINDS[kind][0]), base, random_examples(0, count=6, vocab=VOCAB), [],
                                 seed=0)
    trainer.add_job(trained)
    while trainer.train_step() is not None:
        pass
    save_adapter(trained.adapter, tmp_path / "adapter", "tiny")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path / "adapter").eval()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = trainer.logits("kind", ids)
        difference = float((ours - peft_model(input_ids=ids).logits).abs().max())
        moved = float((ours - reference(input_ids=ids).logits).abs().max())
    assert moved > 1e-3 and difference <= 1e-5, (difference, moved)
    # the folder restores every tensor of the adapter (A0 and B0 out of the rank-2r conversion)
    copy_handle = add_adapter(base.model, "copy", trained.spec.lora, seed=5)
    if "init_lora_weights" in KINDS[kind][0]:
        for layer in copy_handle.layers.values():
            layer.lora_A0.zero_()
            layer.lora_B0.zero_()
    load_adapter_weights(copy_handle, tmp_path / "adapter")
    for (key, value), (_, restored) in zip(adapter_state_dict(trained.adapter).items(),
                                           adapter_state_dict(copy_handle).items(), strict=True):
        assert torch.equal(value, restored), key


@pytest.mark.parametrize("use_dora", [False, True])
def test_loraplus_takes_peft_create_loraplus_optimizers_updates(use_dora, tmp_path):
    """LoRA+ with ratio 8: B (and DoRA's magnitudes, 1-d parameters, as PEFT groups them) at lr * 8."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config("llama", VOCAB)).eval()
    examples = random_examples(3, count=6, vocab=VOCAB, min_len=14, max_len=14)
    spec = job("plus", {"loraplus_lr_ratio": 8.0, "use_dora": use_dora}, weight_decay=0.05, max_grad_norm=1.0)
    base = from_module(copy.deepcopy(reference), None)
    trained = TrainingJob.attach(spec, base, FixedOrder(examples, 2), [], total_steps=3, seed=0)
    save_adapter(trained.adapter, tmp_path / "initial", "tiny")
    trainer = FusedTrainer(base)
    trainer.add_job(trained)
    while trainer.train_step() is not None:
        pass
    ours = adapter_state_dict(trained.adapter)

    peft_model = PeftModel.from_pretrained(reference, tmp_path / "initial", is_trainable=True)
    optimizer = create_loraplus_optimizer(peft_model, torch.optim.AdamW, lr=spec.lr, loraplus_lr_ratio=8.0,
                                          loraplus_weight_decay=spec.weight_decay)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    for start in range(0, len(examples), 2):
        rows = [{"input_ids": list(e.input_ids), "labels": list(e.labels)} for e in examples[start:start + 2]]
        batch = pad_rows(rows)
        peft_model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    theirs = {peft_key_back(name): p.detach() for name, p in peft_model.named_parameters() if p.requires_grad}
    assert set(theirs) == set(ours)
    initial = load_file(str(tmp_path / "initial" / WEIGHTS_NAME))
    # the updates agree to 1e-3 of their size: Adam's first steps turn the float32 rounding of a gradient near
    # zero into a visible share of a step (measured with DoRA: 2e-4 of an A's update, 6e-5 of a B's; the
    # gradients themselves agree to 1e-5 relative, test_each_kind_matches_peft_init_forward_and_gradients)
    for key, value in theirs.items():
        update = float((value - initial[key]).abs().max())
        assert float((ours[key] - value).abs().max()) <= 1e-3 * update, key
    b_moved = max(float((theirs[k] - initial[k]).abs().max()) for k in theirs if "lora_B" in k)
    a_moved = max(float((theirs[k] - initial[k]).abs().max()) for k in theirs if "lora_A" in k)
    assert b_moved > 4 * a_moved, (b_moved, a_moved)   # the ratio took effect


def peft_key_back(name: str) -> str:
    return name.replace(".default.weight", ".weight").replace("lora_magnitude_vector.weight", "lora_magnitude_vector")


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


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_dora_on_a_quantized_base_matches_peft(quantization):
    """QDoRA: the row norms of the dequantized weight, the base's own quantized product otherwise, as PEFT."""
    pytest.importorskip("bitsandbytes")
    from actors.engine.models import keep_quantized_layers_trainable, quantize_linears

    reference = tiny_model("llama", VOCAB)
    models = []
    for _ in range(2):   # quantized from the same float weights: the same quantized base twice
        model = copy.deepcopy(reference)
        quantize_linears(model, quantization, torch.float32, torch.device("cpu"))
        keep_quantized_layers_trainable(model)
        models.append(model)
    base = from_module(models[0], None)
    handle = add_adapter(base.model, "job", LoraConfig(r=4, alpha=8, target_modules="all-linear", use_dora=True),
                         seed=0)
    peft_model = get_peft_model(models[1], PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                          use_dora=True)).eval()
    peft_params = dict(peft_model.named_parameters())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in handle.named_parameters():
            if "magnitude" in name:   # initialised to the dequantized weight's norms in both
                torch.testing.assert_close(param, peft_params[peft_key(name)], rtol=1e-5, atol=1e-6)
            if "lora_A" not in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
            peft_params[peft_key(name)].copy_(param)
    set_adapters_training(base.model, False)
    ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    logits, peft_logits = aspen_logits(base.model, "job", ids), peft_model(input_ids=ids).logits
    logits.square().mean().backward()
    peft_logits.square().mean().backward()
    assert (logits - peft_logits).abs().max() <= 2e-6
    for name, param in handle.named_parameters():
        peft_grad = peft_params[peft_key(name)].grad
        scale = float(peft_grad.abs().max())
        assert scale > 0 and float((param.grad - peft_grad).abs().max()) <= 1e-5 * scale, name


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


def test_the_exported_config_is_peft_s_conversion(tmp_path):
    """A PiSSA adapter's folder is PEFT's rank-2r LoRA (r and alpha doubled, init true): PEFT loading it
    must not decompose the base again."""
    import json

    base = from_module(tiny_model("llama", VOCAB), None)
    handle = add_adapter(base.model, "p", LoraConfig(r=4, alpha=8, init_lora_weights="pissa", use_dora=True), seed=0)
    save_adapter(handle, tmp_path, "tiny")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"], config["use_dora"]) == (8, 16, True, True)


def test_the_step_memory_prior_counts_what_dora_keeps_for_backward():
    """What autograd keeps for a DoRA adapter beyond a plain one (counted by the saved-tensor hooks the
    trainer's CPU meter uses) against memory_prior.adapter_bytes' two (out) rows per token and layer; PiSSA's
    frozen product keeps nothing per token."""
    from actors.engine.memory import SavedTensorCounter, _storage_key
    from actors.engine.memory_prior import adapter_bytes

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
