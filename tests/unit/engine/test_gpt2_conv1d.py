"""GPT-2's Conv1D projections (actors/engine/conv1d_layers.py) against transformers and PEFT on the checkpoint's own
layout: a GPT-2 folder loads with its Conv1D layers as linear layers of the same product (the HF model's logits),
`all-linear` adapts the layers PEFT's `all-linear` adapts, and a trained job's adapter is saved as PEFT saves one of a
Conv1D base (`fan_in_fan_out`), so that `aspen export --merge` (which then leaves the file-by-file merge to PEFT)
gives the merged model PEFT's unmerged logits. (Its fused step against HF + PEFT, and its greedy decoding against
HF's `generate`, are tested with the other model types in test_model_families.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from actors.checkpoint.adapter_export import export_merged
from actors.checkpoint.peft_io import save_adapter
from actors.checkpoint.streamed_merge import reason_not
from actors.engine.adapter_surgery import resolve_targets
from actors.engine.conv1d_layers import conv1d_as_linear, from_conv1d
from actors.engine.job import TrainingJob
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.local_run import train_locally
from tests.helpers.fused import job_spec
from tests.helpers.model_families import VOCAB, build_config, build_model
from tests.helpers.models import VOCAB as TOKENIZER_VOCAB
from tests.helpers.models import random_examples
from tests.helpers.service import job_dict, run_spec, write_task_data

pytestmark = pytest.mark.unit
# float32 on the CPU: the same product with its weight laid out the other way may be summed in another order,
# a few float32 epsilons of each logit's scale per layer
TOLERANCE = 1e-5


@pytest.fixture
def gpt2_folder(tmp_path, tiny_tokenizer):
    # tied as GPT-2's checkpoints are; the cut tokenizer's vocabulary (a jobs file reads text with it)
    model = build_model(build_config("gpt2", tie_word_embeddings=True, vocab_size=TOKENIZER_VOCAB))
    with torch.no_grad():   # GPT-2's biases start at zero: make them count
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def reference(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def tokens() -> torch.Tensor:
    return torch.tensor([random_examples(5, count=1, vocab=VOCAB, min_len=30, max_len=30)[0].input_ids])


def trained(base, lora: dict, steps: int, gpt2_folder, tmp_path) -> tuple[TrainingJob, object]:
    """A job of `lora` trained `steps` steps on `base`, and the folder its adapter is saved in."""
    job = TrainingJob.create(job_spec("a", lora=lora, max_steps=steps, lr=5e-2), base,
                             random_examples(0, vocab=VOCAB), [], seed=0)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    return job, save_adapter(job.adapter, tmp_path / "adapter", str(gpt2_folder))


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE * float(expected.abs().max()))


def test_a_gpt2_folder_loads_with_linear_layers_of_the_same_product(gpt2_folder):
    hf = reference(gpt2_folder)
    conv_names = sorted(name for name, module in hf.named_modules() if isinstance(module, Conv1D))
    assert len(conv_names) == 4 * hf.config.n_layer   # c_attn, attn.c_proj, c_fc, mlp.c_proj
    base = load_base_model(str(gpt2_folder), dtype="float32", device="cpu")
    assert not any(isinstance(module, Conv1D) for module in base.model.modules())
    for name in conv_names:
        layer = base.model.get_submodule(name)
        assert isinstance(layer, torch.nn.Linear) and from_conv1d(layer)
        assert torch.equal(layer.weight, hf.get_submodule(name).weight.t())
    with torch.no_grad():
        close(base.model(tokens(), use_cache=False).logits, hf(tokens(), use_cache=False).logits)
    # PEFT's `all-linear` on the checkpoint's own model (Conv1D layers included, the LM head left out)
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(reference(gpt2_folder), LoraConfig(r=2, target_modules="all-linear"))
    adapted = sorted(name.removeprefix("base_model.model.").removesuffix(".lora_A.default")
                     for name, _ in peft_model.named_modules() if name.endswith(".lora_A.default"))
    assert resolve_targets(base.model, "all-linear") == adapted
    assert conv1d_as_linear(base.model) == 0   # nothing left to convert


def test_a_trained_adapter_is_peft_s_and_merges_into_the_checkpoint_s_layout(gpt2_folder, tmp_path):
    base = load_base_model(str(gpt2_folder), dtype="float32", device="cpu")
    job, folder = trained(base, {"r": 4, "alpha": 8, "target_modules": "all-linear"}, 3, gpt2_folder, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
    assert reason_not(folder, gpt2_folder) == "the adapter trains biases, transposed or other modules"
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(reference(gpt2_folder), str(folder)).eval()
    assert all(layer.fan_in_fan_out for name, layer in adapted.named_modules()
               if name.endswith(("c_attn", "c_proj", "c_fc")) and hasattr(layer, "fan_in_fan_out"))
    merged = AutoModelForCausalLM.from_pretrained(export_merged(folder, tmp_path / "merged"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    plain = reference(gpt2_folder)
    with torch.no_grad():
        expected = adapted(tokens(), use_cache=False).logits
        # the adapter trained: the merged model is not the base
        assert float((expected - plain(tokens(), use_cache=False).logits).abs().max()) > 1e-3
        # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a few epsilons a layer
        close(merged(tokens(), use_cache=False).logits, expected)
    assert any(isinstance(module, Conv1D) for module in merged.modules())   # saved in the checkpoint's layout


def test_a_jobs_file_on_a_gpt2_folder_trains_in_process_and_saves_peft_s_adapter(gpt2_folder, tmp_path):
    """`aspen run --in-process` on a GPT-2 folder: the step planned by the memory model, GPT-2's own layer names as
    targets, the saved adapter loaded by PEFT on the checkpoint's Conv1D model with the trained weights."""
    data = write_task_data(tmp_path / "data", "task")
    jobs = [job_dict("one", data, 3, lora={"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_fc"]}),
            job_dict("two", data, 3, lora={"r": 2, "alpha": 4, "target_modules": "all-linear"})]
    summaries = train_locally(run_spec(str(gpt2_folder), tmp_path / "out", jobs), progress=False)
    assert [summary.state for summary in summaries] == ["completed", "completed"]
    from peft import PeftModel
    from safetensors.torch import load_file

    for name, per_layer in (("one", 2), ("two", 4)):   # adapted layers a decoder layer (two of them)
        folder = tmp_path / "out" / name
        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert len(saved) == 2 * per_layer * 2
        assert json.loads((folder / "adapter_config.json").read_text())["fan_in_fan_out"] is True
        adapted = PeftModel.from_pretrained(reference(gpt2_folder), str(folder))
        loaded = {key.replace(".default", ""): value for key, value in adapted.state_dict().items() if "lora_" in key}
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[key], saved[key]) for key in saved)
        assert max(float(value.abs().max()) for key, value in saved.items() if "lora_B" in key) > 0


def test_a_gpt2_base_quantized_as_it_loads_saves_peft_s_adapter_of_its_conv1d_layers(gpt2_folder, tmp_path):
    """`quantization: nf4` on a GPT-2 folder: transformers' on-the-fly quantization makes bitsandbytes' layers of the
    Conv1D ones (transposing their weights); the adapter over them is still saved as a Conv1D base's (a merge into
    the checkpoint's float layout transposes it), and trains."""
    bnb = pytest.importorskip("bitsandbytes")
    base = load_base_model(str(gpt2_folder), dtype="float32", device="cpu", quantization="nf4")
    layer = base.model.get_submodule("transformer.h.0.attn.c_attn")
    assert isinstance(layer, bnb.nn.Linear4bit) and from_conv1d(layer)
    job, folder = trained(base, {"r": 4, "alpha": 8, "target_modules": ["c_attn"]}, 2, gpt2_folder, tmp_path)
    assert json.loads((folder / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    assert max(float(p.abs().max()) for name, p in job.adapter.named_parameters() if "lora_B" in name) > 0
