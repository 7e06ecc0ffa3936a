"""The adapter kinds of PEFT's LoraConfig against PEFT 0.21 itself (the independent reference): DoRA
(`use_dora`, also on an int8 / nf4 base: QDoRA), PiSSA / OLoRA (`init_lora_weights`) and LoRA+
(`loraplus_lr_ratio`, PEFT's create_loraplus_optimizer). Same initialisation, same forward, same gradients; PEFT
loads the exported folder (a PiSSA adapter as PEFT's own rank-2r conversion) onto the unmodified base and computes
the same logits; LoRA+ takes PEFT's updates. The kinds in aspen's trainer, checkpoints, estimates and refusals:
test_adapter_kinds_engine.py."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.optimizers import create_loraplus_optimizer
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from actors.checkpoint.peft_io import CONFIG_NAME, WEIGHTS_NAME, adapter_state_dict, load_adapter_weights, save_adapter
from actors.engine.adapter_surgery import add_adapter, set_adapters_training
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.lora_config import LoraConfig
from tests.helpers.accumulation import FixedOrder, pad_rows
from tests.helpers.adapter_kinds import VOCAB, job
from tests.helpers.adapter_logits import SameMask, aspen_logits
from tests.helpers.models import random_examples, tiny_config, tiny_model

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


def assert_forward_and_gradients_equal_peft(model, handle, peft_model, peft_params: dict, ids: torch.Tensor
                                            ) -> torch.Tensor:
    """aspen's logits through adapter "job" equal PEFT's, and so does each adapter parameter's gradient of the
    mean squared logit (relative to PEFT's largest, which is never zero); PEFT's logits."""
    logits, peft_logits = aspen_logits(model, "job", ids), peft_model(input_ids=ids).logits
    logits.square().mean().backward()
    peft_logits.square().mean().backward()
    assert (logits - peft_logits).abs().max() <= 2e-6
    for name, param in handle.named_parameters():
        peft_grad = peft_params[peft_key(name)].grad
        scale = float(peft_grad.abs().max())
        assert scale > 0, name
        assert float((param.grad - peft_grad).abs().max()) <= 1e-5 * scale, name
    return peft_logits


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
    peft_logits = assert_forward_and_gradients_equal_peft(base.model, handle, peft_model, peft_params, ids)
    # the kind changes the result: plain LoRA with the same A and B computes other logits
    plain = from_module(copy.deepcopy(reference), None)
    plain_handle = add_adapter(plain.model, "job", LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    with torch.no_grad():
        trained = dict(handle.named_parameters())
        for name, param in plain_handle.named_parameters():
            param.copy_(trained[name])
        set_adapters_training(plain.model, False)
        assert (aspen_logits(plain.model, "job", ids) - peft_logits).abs().max() > 1e-3


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
    assert_forward_and_gradients_equal_peft(base.model, handle, peft_model, peft_params, ids)


def test_the_exported_config_is_peft_s_conversion(tmp_path):
    """A PiSSA adapter's folder is PEFT's rank-2r LoRA (r and alpha doubled, init true): PEFT loading it
    must not decompose the base again."""
    import json

    base = from_module(tiny_model("llama", VOCAB), None)
    handle = add_adapter(base.model, "p", LoraConfig(r=4, alpha=8, init_lora_weights="pissa", use_dora=True), seed=0)
    save_adapter(handle, tmp_path, "tiny")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"], config["use_dora"]) == (8, 16, True, True)
