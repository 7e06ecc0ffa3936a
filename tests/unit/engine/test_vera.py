"""VeRA (`lora.kind: vera`) against PEFT 0.21's VeraConfig (the independent reference): the projections PEFT
draws from the same `projection_prng_key` (equal, bit for bit, not loaded into aspen), the same initial
vectors, the same forward and gradients (with dropout too, the same masks given to both), a saved folder
with PEFT's own keys and config that PEFT loads onto the unmodified base to the same logits; a VeRA job fused
with LoRA and DoRA jobs trains exactly as alone; a checkpoint resumes it; bad combinations are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel, VeraConfig, get_peft_model
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.checkpoint.peft_io import CONFIG_NAME, WEIGHTS_NAME, adapter_state_dict, load_adapter_weights, save_adapter
from actors.engine.adapter_surgery import add_adapter, set_adapters_training
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.job_fit import job_adapter_bytes
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from tests.helpers.adapter_logits import SameMask, aspen_logits
from tests.helpers.isolation import assert_isolated
from tests.helpers.models import random_examples, tiny_model

VOCAB = 300
R = 16


def peft_key(name: str) -> str:
    """PEFT's parameter name for one of AdapterHandle.named_parameters()'s VeRA vectors."""
    return f"base_model.model.{name}.default"


def vera_pair(targets, *, dropout: float = 0.0, key: int = 7):
    reference = tiny_model("llama", VOCAB)
    base = from_module(copy.deepcopy(reference), None)
    config = LoraConfig(kind="vera", r=R, target_modules=targets, projection_prng_key=key, dropout=dropout)
    handle = add_adapter(base.model, "job", config, seed=0)
    peft_model = get_peft_model(copy.deepcopy(reference), VeraConfig(r=R, target_modules=targets,
                                                                      projection_prng_key=key, vera_dropout=dropout))
    return reference, base, handle, peft_model


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_projections_and_initial_vectors_are_peft_s(targets):
    """Drawn here from the key, not copied from PEFT: equal bit for bit, sized for the largest layer (all-linear:
    in 128 from down_proj, out 128 from gate/up_proj), and every layer reads the one shared pair."""
    _, _, handle, peft_model = vera_pair(targets)
    theirs_a, theirs_b = peft_model.base_model.vera_A["default"], peft_model.base_model.vera_B["default"]
    assert torch.equal(handle.projections.vera_A, theirs_a) and torch.equal(handle.projections.vera_B, theirs_b)
    if targets == "all-linear":
        assert tuple(theirs_a.shape) == (R, 128) and tuple(theirs_b.shape) == (128, R)
    assert all(layer.projections is handle.projections for layer in handle.layers.values())
    peft_params = dict(peft_model.named_parameters())
    ours = dict(handle.named_parameters())
    assert {peft_key(name) for name in ours} == {k for k, p in peft_params.items() if p.requires_grad}
    for name, param in ours.items():
        assert torch.equal(param, peft_params[peft_key(name)]), name
    # another key, other projections
    _, _, other, _ = vera_pair(targets, key=8)
    assert not torch.equal(other.projections.vera_A, handle.projections.vera_A)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_forward_and_gradients_equal_peft_s(dropout):
    reference, base, handle, peft_model = vera_pair("all-linear", dropout=dropout)
    peft_params = dict(peft_model.named_parameters())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():   # away from the initialisation (lambda_b = 0 is a no-op), the same values in both
        for name, param in handle.named_parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=generator))
            peft_params[peft_key(name)].copy_(param)
    ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    if dropout:
        set_adapters_training(base.model, True)
        peft_model.train()
        masks = torch.Generator().manual_seed(0)
        masks.set_state(handle.dropout_generator.get_state())
        for module in peft_model.modules():
            if hasattr(module, "vera_dropout") and "default" in module.vera_dropout:
                module.vera_dropout["default"] = SameMask(dropout, masks)
    else:
        set_adapters_training(base.model, False)
        peft_model.eval()
    logits, peft_logits = aspen_logits(base.model, "job", ids), peft_model(input_ids=ids).logits
    logits.square().mean().backward()
    peft_logits.square().mean().backward()
    assert (logits - peft_logits).abs().max() <= 2e-6
    with torch.no_grad():
        assert (peft_logits - reference(input_ids=ids).logits).abs().max() > 1e-3   # the adapter does something
    for name, param in handle.named_parameters():
        peft_grad = peft_params[peft_key(name)].grad
        scale = float(peft_grad.abs().max())
        assert scale > 0, name
        assert float((param.grad - peft_grad).abs().max()) <= 1e-5 * scale, name


def vera_job(name: str, lora: dict | None = None, **fields) -> JobSpec:
    settings = {"data": "unused.jsonl", "format": {"type": "text"}, "batch_size": 2, "max_steps": 3, "lr": 1e-2,
                "lr_schedule": "constant", **fields}
    return JobSpec(name=name, lora={"kind": "vera", "r": R, "target_modules": "all-linear", **(lora or {})},
                   **settings)


def trained_vera(lora: dict | None = None):
    reference = tiny_model("llama", VOCAB)
    base = from_module(copy.deepcopy(reference), None)
    trainer = FusedTrainer(base)
    job = TrainingJob.create(vera_job("vera", lora), base, random_examples(0, count=6, vocab=VOCAB), [], seed=0)
    trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    return reference, base, trainer, job


@pytest.mark.parametrize("save_projection", [True, False])
def test_the_saved_adapter_is_peft_s_and_peft_loads_it(save_projection, tmp_path):
    reference, base, trainer, job = trained_vera({"save_projection": save_projection, "projection_prng_key": 3})
    save_adapter(job.adapter, tmp_path / "ours", "tiny")
    # PEFT's own folder for the same config: the same keys and shapes, the same config fields
    peft_model = get_peft_model(copy.deepcopy(reference),
                                VeraConfig(task_type="CAUSAL_LM", r=R, target_modules=job.adapter.peft_targets,
                                           projection_prng_key=3, save_projection=save_projection))
    peft_model.save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(str(tmp_path / "ours" / WEIGHTS_NAME)), load_file(str(tmp_path / "peft" / WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert ("base_model.vera_A" in ours) is save_projection
    if save_projection:
        assert torch.equal(ours["base_model.vera_A"], theirs["base_model.vera_A"])
    our_config = json.loads((tmp_path / "ours" / CONFIG_NAME).read_text())
    peft_config = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())
    assert our_config["peft_type"] == "VERA"
    for field in ("r", "projection_prng_key", "save_projection", "d_initial", "vera_dropout", "task_type"):
        assert our_config[field] == peft_config[field], field
    # PEFT loads it onto the unmodified base (without the projections: drawn again from the key)
    loaded = PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path / "ours").eval()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = trainer.logits("vera", ids)
        difference = float((logits - loaded(input_ids=ids).logits).abs().max())
        moved = float((logits - reference(input_ids=ids).logits).abs().max())
    assert moved > 1e-3 and difference <= 1e-5, (difference, moved)
    # the folder restores the adapter
    restored = add_adapter(base.model, "copy", job.spec.lora, seed=5)
    load_adapter_weights(restored, tmp_path / "ours")
    for (key, value), (_, again) in zip(adapter_state_dict(job.adapter).items(),
                                        adapter_state_dict(restored).items(), strict=True):
        assert torch.equal(value, again), key


def test_projections_saved_elsewhere_are_the_ones_loaded(tmp_path):
    """A folder whose projections differ from what the key draws here (drawn on another system) is loaded with
    its own projections, as PEFT does, for that adapter only: the job sharing the key keeps its own."""
    _, base, trainer, job = trained_vera()
    save_adapter(job.adapter, tmp_path, "tiny")
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    tensors["base_model.vera_A"] = tensors["base_model.vera_A"] * 2
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    restored = add_adapter(base.model, "copy", job.spec.lora, seed=0)
    assert restored.projections is job.adapter.projections   # the same key, rank and shapes: shared
    load_adapter_weights(restored, tmp_path)
    assert torch.equal(restored.projections.vera_A, tensors["base_model.vera_A"])
    assert all(layer.projections is restored.projections for layer in restored.layers.values())
    assert torch.equal(job.adapter.projections.vera_A, tensors["base_model.vera_A"] / 2)


def mixed_jobs():
    specs = [vera_job("vera", {"dropout": 0.2}),
             vera_job("vera-q", {"r": 8, "target_modules": ["q_proj", "o_proj"], "d_initial": 0.5,
                                 "projection_prng_key": 4}, batch_size=3),
             JobSpec(name="lora", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=3, lr=1e-2,
                     lora={"r": 4, "alpha": 8, "target_modules": "all-linear", "dropout": 0.1}),
             JobSpec(name="dora", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=3, lr=1e-2,
                     lora={"r": 4, "alpha": 8, "target_modules": "all-linear", "use_dora": True})]
    return [(spec, random_examples(index, count=9, vocab=VOCAB, min_len=5, max_len=30), index)
            for index, spec in enumerate(specs)]


def test_vera_fused_with_lora_and_dora_trains_exactly_as_alone():
    """Each job ends with the weights and per-step losses of its solo run, bit for bit (CPU, float32)."""
    assert_isolated(from_module(tiny_model("llama", VOCAB), None), mixed_jobs())


def test_a_resumed_vera_job_ends_as_the_uninterrupted_one(tmp_path):
    """Stopped mid-accumulation and resumed from its checkpoint: the same losses and vectors as uninterrupted."""
    base = from_module(tiny_model("llama", VOCAB), None)
    spec = vera_job("resumable", {"dropout": 0.1}, max_steps=4, lr_schedule="cosine", grad_accum=2)
    data = random_examples(0, count=16, vocab=VOCAB)

    def run(job: TrainingJob, steps: int | None) -> None:
        trainer = FusedTrainer(base)
        trainer.add_job(job)
        taken = 0
        while not job.done and (steps is None or taken < steps):
            trainer.train_step()
            taken += 1
        trainer.remove_job(job.name)

    uninterrupted = TrainingJob.create(spec, base, data, [], seed=0)
    run(uninterrupted, None)
    expected = adapter_state_dict(uninterrupted.adapter)
    interrupted = TrainingJob.create(spec, base, data, [], seed=0)
    run(interrupted, 3)
    save_checkpoint(interrupted, tmp_path / "ckpt", "tiny")
    resumed = TrainingJob.create(spec, base, data, [], seed=0)
    load_checkpoint(resumed, tmp_path / "ckpt")
    run(resumed, None)
    assert [r.loss for r in resumed.history] == [r.loss for r in uninterrupted.history]
    for key, value in adapter_state_dict(resumed.adapter).items():
        assert torch.equal(value, expected[key]), key


def test_spec_defaults_and_refusals():
    assert LoraConfig(kind="vera").r == 256 and LoraConfig().r == 8 and LoraConfig().kind == "lora"
    for field, value in [("alpha", 32), ("use_dora", True), ("use_rslora", True), ("init_lora_weights", "pissa"),
                         ("loraplus_lr_ratio", 4.0)]:
        with pytest.raises(ValidationError, match=rf"lora.{field} does not apply to lora.kind: vera.*remove lora"):
            LoraConfig(kind="vera", **{field: value})
    for field, value in [("projection_prng_key", 3), ("d_initial", 0.5), ("save_projection", False)]:
        with pytest.raises(ValidationError, match=rf"lora.{field} is a VeRA setting; set lora.kind: vera"):
            LoraConfig(**{field: value})
    with pytest.raises(ValidationError, match="kind"):
        LoraConfig(kind="ia3")
    # a dumped spec carries every field at its default: it validates again, as the service round-trips it
    for config in (LoraConfig(), LoraConfig(kind="vera", d_initial=0.5, projection_prng_key=3, save_projection=False)):
        assert LoraConfig.model_validate(config.model_dump()) == config


def test_memory_estimate_counts_vectors_and_projections():
    """PEFT's trainable VeRA values at 16 bytes each (weight, gradient, two moments) and its projections at 4."""
    from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER, BYTES_PER_FROZEN_VALUE
    from policies.base import TrainerView

    model = tiny_model("llama", VOCAB)
    output = model.get_output_embeddings()
    shapes = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not output)
    view = TrainerView(id="t", base_model="m", quantization="none", memory_budget_bytes=1, base_bytes=0,
                       step_memory_bytes=0, jobs=(), linear_shapes=shapes)
    peft_model = get_peft_model(model, VeraConfig(r=R, target_modules="all-linear"))
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    shared = peft_model.base_model
    projections = sum(t.numel() for t in (*shared.vera_A.values(), *shared.vera_B.values()))
    lora = LoraConfig(kind="vera", r=R, target_modules="all-linear")
    assert job_adapter_bytes(lora, view) == BYTES_PER_ADAPTER_PARAMETER * trained + BYTES_PER_FROZEN_VALUE * projections
