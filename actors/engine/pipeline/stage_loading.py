"""Loading one pipeline stage's weights only, so that a base larger than one host's memory can be cut.

The model is built on `meta` from its config (no memory), then the tensors of the stage's own modules (its
decoder layers; stage 0 the token embeddings; the last stage the final norm and the LM head, tied or not)
are read one by one from the checkpoint's safetensors files straight to the stage's device; the rest stays
on `meta`. A `.gguf` base is read from its converted folder (actors/storage/gguf_cache.py), converted once by
whichever process gets there first. Checked against loading the whole base and cutting it
(tests/unit/engine/test_pipeline_loading.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from actors.engine.adapter_surgery import freeze
from actors.engine.attention import use_varlen_attention
from actors.engine.model_support import causal_lm_config, check_model_support
from actors.engine.models import BaseModel, load_base_model, resolve_device, resolve_dtype
from actors.engine.moe_experts import has_experts
from actors.engine.pipeline.stage_model import (
    StageModel,
    check_stage_fits,
    check_stageable_type,
    cut_stage,
    stage_bytes,
)
from actors.engine.recompute import decoder_layers
from actors.engine.stateful_layers import use_per_sequence_state
from actors.storage.gguf_cache import converted_source
from actors.storage.sources import load_tokenizer, resolve_source


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a sharded checkpoint's index, or the single file)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no safetensors checkpoint: a pipeline stage reads its own tensors "
                                "from one (save the model with save_pretrained, which writes safetensors)")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            out.update(dict.fromkeys(handle.keys(), file))
    return out


def load_stage(base_model: str, split: list[int], stage: int, *, device: str = "auto", dtype: str = "auto"
               ) -> StageModel:
    """Stage `stage` of `split` (layer counts per stage) of `base_model`, reading only its tensors."""
    source = resolve_source(base_model)
    read_from = converted_source(source)
    if read_from.gguf_file is not None:
        raise ValueError(f"base_model '{base_model}': a pipeline stage reads its tensors from a Hugging Face folder; "
                         "this GGUF file has no converted folder (ASPEN_CACHE_DIR=off?): set a cache folder")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    config = AutoConfig.from_pretrained(read_from.path, local_files_only=read_from.local_files_only)
    transform = check_model_support(config, base_model)
    if causal_lm_config(config) is not config:
        raise ValueError(f"base_model '{base_model}' is a {config.model_type} checkpoint whose text model is stored "
                         "inside a vision-language model's: a pipeline stage reads its own tensors by name, under "
                         "the text model's names; train it on one device (no `stages`)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    if has_experts(model):
        raise ValueError(f"base_model '{base_model}' is an MoE model ({config.model_type}): a pipeline stage reads its "
                         "own tensors by name, and MoE checkpoints keep each expert's weights apart, which "
                         "transformers stacks only as the whole model loads: train it on one device (no `stages`)")
    check_stageable_type(config.model_type, base_model)   # before its layers are read (GPT-2's have other names)
    decoder = getattr(model, model.base_model_prefix)
    layers = decoder_layers(decoder)
    if sum(split) != len(layers):
        raise ValueError(f"pipeline split {split} holds {sum(split)} layers; the model has {len(layers)}")
    first_layer = sum(split[:stage])
    first, last = stage == 0, stage == len(split) - 1
    embeddings, head = decoder.get_input_embeddings(), model.get_output_embeddings()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    own: list[nn.Module] = [layers[index] for index in range(first_layer, first_layer + split[stage])]
    if first or (last and tied):
        own.append(embeddings)
    if last:
        own += [decoder.norm] + ([] if tied else [head])
    names = {id(module): name for name, module in model.named_modules()}
    prefixes = [names[id(module)] + "." for module in own]
    check_stage_fits(stage, stage_bytes(own), torch_device)   # before anything is allocated on the device
    for module in own:
        module.to_empty(device=torch_device)
    files = checkpoint_files(Path(read_from.path))
    wanted = {name: file for name, file in files.items() if name.startswith(tuple(prefixes))}
    by_file: dict[Path, list[str]] = {}
    for name, file in wanted.items():
        by_file.setdefault(file, []).append(name)
    parameters = dict(model.named_parameters())
    for file, tensors in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in tensors:
                target = parameters[name] if name in parameters else model.get_buffer(name)
                with torch.no_grad():
                    target.copy_(handle.get_tensor(name).to(torch_dtype))
    if tied:   # materialising the embeddings made them a new tensor: the head shares it again
        head.weight = embeddings.weight
    if hasattr(decoder, "rotary_emb"):   # its buffers are computed, not stored: build it on the device
        with torch.device(torch_device):
            decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    missing = sorted(f"{names[id(module)]}.{name}" for module in own for name, _ in module.named_parameters()
                     if f"{names[id(module)]}.{name}" not in wanted)
    if missing:
        raise ValueError(f"base_model '{base_model}': its checkpoint lacks {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}, which this pipeline stage needs")
    freeze(model)
    model.eval()
    use_varlen_attention(model)
    use_per_sequence_state(model)
    base = BaseModel(name=base_model, model=model, tokenizer=load_tokenizer(read_from), device=torch_device,
                     dtype=torch_dtype, quantization="none", source=source, logit_transform=transform)
    return cut_stage(base, split, stage, torch_device)


@dataclass(frozen=True)
class StageLoader:
    """A pipeline's base by name: whole (`__call__`, for the head's measured split) or one stage's tensors only
    (`stage`, what each stage process loads)."""

    base_model: str
    dtype: str = "auto"

    def __call__(self) -> BaseModel:
        return load_base_model(self.base_model, dtype=self.dtype, device="cpu")

    def layers(self) -> int:
        source = converted_source(resolve_source(self.base_model))
        config = AutoConfig.from_pretrained(source.path, local_files_only=source.local_files_only,
                                            **({"gguf_file": source.gguf_file} if source.gguf_file else {}))
        return int(config.num_hidden_layers)

    def stage(self, split: list[int], stage: int, device: str) -> StageModel:
        return load_stage(self.base_model, split, stage, device=device, dtype=self.dtype)
