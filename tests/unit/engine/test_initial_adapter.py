"""A job started from a saved adapter (`init_adapter`), against PEFT: an adapter PEFT trained and saved gives the
job PEFT's logits and first loss, in the dtype PEFT saved it in; one that does not fit the job is refused, naming
the setting or the tensor and the fix, and leaves the job's adapter as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from actors.checkpoint.initial_adapter import start_from_adapter
from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.job import TrainingJob
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from actors.spec.saved_adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterFileError
from tests.helpers.accumulation import pad_rows
from tests.helpers.fused import job_spec
from tests.helpers.models import random_examples
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_adapter(folder, out, *, seed: int = 0, dtype: torch.dtype = torch.float32, **lora) -> None:
    """A LoRA adapter as PEFT saves it, every weight random (B too, DoRA's magnitudes moved): what a trained one is."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 12, "target_modules": TARGETS, "lora_dropout": 0.0, **lora}
    peft_model = get_peft_model(model, PeftLoraConfig(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            elif "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.2 * torch.rand(parameter.shape, generator=generator))
    peft_model.save_pretrained(out)
    if dtype != torch.float32:   # as a bf16 training run leaves it
        tensors = {key: value.to(dtype) for key, value in load_file(str(out / WEIGHTS_NAME)).items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})


def _job(base, name: str, **lora):
    spec = job_spec(name, batch_size=2, lr=1e-3, warmup_steps=0,
                    lora={"r": 4, "alpha": 12, "dropout": 0.0, "target_modules": TARGETS, **lora})
    return TrainingJob.create(spec, base, random_examples(5, count=4, min_len=12, max_len=24), [], seed=0)


@pytest.mark.parametrize("variant,dtype", [({}, torch.float32), ({"use_rslora": True, "use_dora": True}, torch.float32),
                                           ({}, torch.bfloat16)], ids=["lora", "rslora-dora", "lora-bf16-file"])
def test_a_job_started_from_a_peft_adapter_gives_peft_its_logits_and_first_loss(variant, dtype, tiny_model_dirs,
                                                                                  tmp_path):
    """The adapter PEFT saved, loaded by PEFT and by aspen's job: the same logits (within the rounding of two
    summation orders of the forward's chain) and the same loss on the job's first micro-batch, which aspen's first
    fused step reports; the optimizer starts at step 0."""
    folder = tiny_model_dirs["llama"]
    _peft_adapter(folder, tmp_path / "adapter", dtype=dtype, **variant)
    base = load_base_model(str(folder), dtype="float32", device="cpu")
    job = _job(base, "continued", **variant)
    note = start_from_adapter(job.adapter, tmp_path / "adapter")
    assert note == f"its adapter started from {tmp_path / 'adapter'}"
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    ids = torch.tensor([random_examples(9, count=1, min_len=20, max_len=20)[0].input_ids] * 2)
    engine_logits = trainer.logits("continued", ids).detach()

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        plain_logits = reference(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert (peft_logits - plain_logits).abs().max() > 1e-2, "the adapter has no effect: nothing was compared"
    config = base.model.config
    logit_bound = rounding_tolerance(llama_chain_terms(config, sequence=20, tokens=20, backward=False),
                                     float(peft_logits.abs().max()))
    assert float((engine_logits - peft_logits).abs().max()) <= logit_bound

    first = job.peek()
    report = trainer.train_step()
    (result,) = report.results
    batch = pad_rows([{"input_ids": list(e.input_ids), "labels": list(e.labels)} for e in first])
    with torch.no_grad():
        peft_loss = float(peft_model(**batch).loss)
    longest = max(len(e.input_ids) for e in first)
    loss_bound = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=longest, backward=False),
                                    2 * peft_loss)
    assert abs(result.loss - peft_loss) <= loss_bound
    assert job.optimizer.step_count == 1   # its first step: the optimizer started afresh


def _rewrite_config(folder, **changes) -> None:
    path = folder / CONFIG_NAME
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _rewrite_tensors(folder, change) -> None:
    tensors = load_file(str(folder / WEIGHTS_NAME))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS_NAME))


CONFIG_CASES = [
    ({"r": 8}, "lora.r is 4, the adapter's r 8: set lora.r: 8"),
    ({"lora_alpha": 16}, "lora.alpha is 12, the adapter's lora_alpha 16: set lora.alpha: 16"),
    ({"use_rslora": True}, "lora.use_rslora is false, the adapter's true: set lora.use_rslora: true"),
    ({"use_dora": True}, "lora.use_dora is false, the adapter's true: set lora.use_dora: true"),
    ({"peft_type": "VERA"}, "the adapter is VERA (peft_type) and the job's lora.kind is lora; set lora.kind: vera"),
    ({"peft_type": "IA3"}, "peft_type is IA3: aspen continues LoRA and VeRA adapters only"),
    ({"bias": "lora_only"}, "bias is 'lora_only': the adapter trains the base's biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is ['lm_head']: the adapter trains whole modules"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is {'q_proj': 8}: the adapter gives some modules another rank"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]},
     "lora.target_parameters is [], the adapter's ['mlp.experts.gate_up_proj'] (the expert stacks it adapts): set "
     "lora.target_parameters: ['mlp.experts.gate_up_proj']"),
]


@pytest.mark.parametrize("changes,expected", CONFIG_CASES, ids=[next(iter(c)) for c, _ in CONFIG_CASES])
def test_an_adapter_config_that_does_not_fit_is_refused_naming_the_setting(changes, expected, tiny_model_dirs,
                                                                            tmp_path):
    folder = tiny_model_dirs["llama"]
    _peft_adapter(folder, tmp_path / "adapter")
    _rewrite_config(tmp_path / "adapter", **changes)
    base = load_base_model(str(folder), dtype="float32", device="cpu")
    job = _job(base, "refused")
    before = adapter_state_dict(job.adapter)
    with pytest.raises(AdapterFileError) as caught:
        start_from_adapter(job.adapter, tmp_path / "adapter")
    assert str(caught.value).startswith(f"init_adapter: {tmp_path / 'adapter' / CONFIG_NAME} does not fit the "
                                        "job's lora: ")
    assert expected in str(caught.value)
    after = adapter_state_dict(job.adapter)
    assert all(torch.equal(before[key], after[key]) for key in before), "a refused adapter changed the job's"


def _no_down_proj(tensors):
    for key in [k for k in tensors if "down_proj" in k]:
        del tensors[key]


def _with_k_proj(tensors):
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.zeros(4, 64)


def _nan(tensors):
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("nan")


def _wider(tensors):
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(4, 96)


TENSOR_CASES = [
    (_no_down_proj, "the job adapts down_proj where the adapter has no weights (4 tensors, e.g. "),
    (_with_k_proj, "the adapter has weights for k_proj the job does not adapt (1 tensors, e.g. "),
    (_nan, "holds non-finite values (inf or nan): the adapter's training diverged"),
    (_wider, "has shape (4, 96), the job's adapter (4, 64): the adapter was trained on a base of another shape"),
]


@pytest.mark.parametrize("change,expected", TENSOR_CASES, ids=["missing", "extra", "nan", "shape"])
def test_adapter_weights_that_do_not_fit_are_refused_naming_the_tensor(change, expected, tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["llama"]
    _peft_adapter(folder, tmp_path / "adapter")
    _rewrite_tensors(tmp_path / "adapter", change)
    base = load_base_model(str(folder), dtype="float32", device="cpu")
    job = _job(base, "refused")
    before = adapter_state_dict(job.adapter)
    with pytest.raises(AdapterFileError) as caught:
        start_from_adapter(job.adapter, tmp_path / "adapter")
    assert str(caught.value).startswith(f"init_adapter: {tmp_path / 'adapter' / WEIGHTS_NAME}: ")
    assert expected in str(caught.value)
    after = adapter_state_dict(job.adapter)
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_unreadable_adapter_files_are_refused_with_what_to_do(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["llama"]
    base = load_base_model(str(folder), dtype="float32", device="cpu")
    job = _job(base, "refused")
    with pytest.raises(AdapterFileError, match=r"adapter_config.json does not exist; give a folder holding "
                                               r"adapter_config.json and adapter_model.safetensors"):
        start_from_adapter(job.adapter, tmp_path / "nowhere")
    _peft_adapter(folder, tmp_path / "adapter")
    weights = tmp_path / "adapter" / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:100])   # a copy cut short
    with pytest.raises(AdapterFileError, match=r"adapter_model.safetensors is not a safetensors file .*; save the "
                                               r"adapter again"):
        start_from_adapter(job.adapter, tmp_path / "adapter")
    (tmp_path / "adapter" / CONFIG_NAME).write_text("{not json")
    with pytest.raises(AdapterFileError, match=r"adapter_config.json is not JSON"):
        start_from_adapter(job.adapter, tmp_path / "adapter")
    shutil.rmtree(tmp_path / "adapter")
