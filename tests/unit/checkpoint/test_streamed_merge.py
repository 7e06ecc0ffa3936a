"""actors/checkpoint/streamed_merge.py: a LoRA adapter merged into its base one weight file at a time gives, bit for
bit, the weights PEFT's `merge_and_unload` gives on the model it builds (float32 and bfloat16 bases, LoRA and
rsLoRA, a base sharded over several files); adapters and bases it cannot merge so are said so, and an adapter
of another base is refused naming the weight."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from actors.checkpoint.streamed_merge import merge_into, reason_not
from tests.helpers.models import VOCAB, tiny_model

pytestmark = pytest.mark.unit
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def saved_base(folder, dtype: torch.dtype):
    model = tiny_model("llama", VOCAB).to(dtype)
    model.save_pretrained(folder, max_shard_size="100KB")   # several weight files and their index
    return folder


def saved_adapter(base_folder, folder, *, rslora: bool = False, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=rslora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


def peft_merged(base_folder, adapter_folder) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype="auto")
    merged = PeftModel.from_pretrained(model, str(adapter_folder)).merge_and_unload()
    return {name: tensor.detach() for name, tensor in merged.state_dict().items()}


def streamed(folder) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("dtype, rslora", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_weights_are_peft_merge_and_unloads_bit_for_bit(tmp_path, dtype, rslora):
    base = saved_base(tmp_path / "base", dtype)
    adapter = saved_adapter(base, tmp_path / "adapter", rslora=rslora)
    assert reason_not(adapter, base) is None
    out = merge_into(adapter, base, tmp_path / "merged")
    ours, theirs = streamed(out), peft_merged(base, adapter)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert ours.keys() <= theirs.keys() and {name for name in theirs if name not in ours} <= {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == dtype and torch.equal(tensor, theirs[name]), name
    changed = [name for name in ours if not torch.equal(ours[name], load_file_any(base, name))]
    assert len(changed) == 2 * len(TARGETS) and all(any(t in name for t in TARGETS) for name in changed)


def load_file_any(folder, name: str) -> torch.Tensor:
    for path in folder.glob("*.safetensors"):
        tensors = load_file(str(path))
        if name in tensors:
            return tensors[name]
    raise KeyError(name)


def test_what_cannot_be_merged_file_by_file_is_said_and_a_foreign_adapter_is_refused(tmp_path):
    base = saved_base(tmp_path / "base", torch.float32)
    adapter = saved_adapter(base, tmp_path / "adapter")
    assert reason_not(adapter, None) == "the base is not a local folder"
    config = json.loads((adapter / "adapter_config.json").read_text())
    for change, says in (({"use_dora": True}, "not a plain LoRA"), ({"bias": "lora_only"}, "biases"),
                         ({"rank_pattern": {"q_proj": 8}}, "rank or alpha patterns"),
                         ({"init_lora_weights": "pissa"}, "initialisation changed its base")):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
        assert says in reason_not(adapter, base)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    declared = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**declared, "dtype": "bfloat16"}))
    assert reason_not(adapter, base) == "the base stores float32 weights but declares bfloat16"
    other = saved_base(tmp_path / "other", torch.float32)
    for path in other.glob("*.safetensors"):   # a base without the weights the adapter updates
        tensors = {name.replace("layers.1.", "layers.9."): t for name, t in load_file(str(path)).items()}
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no weight named model.layers.1"):
        merge_into(adapter, other, tmp_path / "foreign")
