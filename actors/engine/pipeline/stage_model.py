"""One pipeline stage's share of the base model: a contiguous run of decoder layers (stage 0 with the token
embeddings, the last stage with the final norm and the LM head).

The stage keeps the model's whole module tree, so that its adapters carry the same module names (PEFT's)
as on a single device and draw their initial weights from the same random sequence; the layers of other
stages are moved to the `meta` device (no memory). Its forward runs the model's own decoder forward over
its layers only (`inputs_embeds` carries the previous stage's hidden states), so the rotary embeddings,
masks and layers compute exactly what they compute on one device."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from actors.engine.models import BaseModel
from actors.engine.recompute import decoder_layers

# model types whose decoder forward does nothing to `inputs_embeds` before its first layer (Gemma scales
# them by sqrt(hidden), so a later stage would scale its input again): checked against one device's forward
# by tests/unit/engine/test_pipeline.py
STAGEABLE = ("llama", "mistral", "qwen2")


@dataclass(kw_only=True)
class StageModel:
    base: BaseModel
    stage: int
    stages: int
    first_layer: int
    layers: int
    view: nn.Module     # the decoder with this stage's layers only (and no final norm before the last stage)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def hidden_size(self) -> int:
        return int(self.base.model.config.hidden_size)

    def forward(self, *, position_ids: torch.Tensor, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """(T, d) hidden states after this stage's layers (the last stage's after the final norm), from token
        ids (stage 0) or the previous stage's (T, d) hidden states."""
        if self.first:
            out = self.view(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=None,
                            use_cache=False)
        else:
            out = self.view(inputs_embeds=hidden[None], position_ids=position_ids[None], attention_mask=None,
                            use_cache=False)
        return out.last_hidden_state[0]

    def held_bytes(self) -> int:
        """Bytes of the weights and buffers this stage holds on its device."""
        return _bytes([self.base.model])


def check_stageable_type(model_type: str | None, name: str) -> None:
    """ValueError where aspen does not cut a base of this type into pipeline stages, saying what to do."""
    if model_type not in STAGEABLE:
        raise ValueError(f"base_model '{name}' (model_type '{model_type}') cannot be cut into pipeline "
                         f"stages yet: aspen cuts {', '.join(STAGEABLE)} (their decoders take the previous "
                         "stage's hidden states unchanged); train it on a single-device trainer (stages: 1)")


def check_stageable(base: BaseModel) -> None:
    check_stageable_type(getattr(base.model.config, "model_type", None), base.name)
    if base.quantization != "none":
        raise ValueError(f"base_model '{base.name}': a pipeline trainer cuts a float base, not a {base.quantization}"
                         " one (quantized layers cannot be moved between devices yet); use stages: 1")


def _bytes(modules: list[nn.Module], *, meta: bool = False) -> int:
    """The bytes of the modules' tensors, each once; those on `meta` (held elsewhere) only with `meta`."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            if id(tensor) not in seen and (meta or not tensor.is_meta):
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


def stage_bytes(modules: list[nn.Module]) -> int:
    """What the modules will take once on a device, whether their tensors are there or still on `meta`."""
    return _bytes(modules, meta=True)


def check_stage_fits(stage: int, needed: int, device: torch.device, free: int | None = None) -> None:
    """Refuse a stage whose weights do not fit its device's free memory (CUDA), naming the numbers."""
    if device.type != "cuda":
        return
    if free is None:
        free = torch.cuda.mem_get_info(device)[0]
    if needed > free:
        raise MemoryError(f"pipeline stage {stage}: its weights need {needed / 2**30:.2f} GiB and {device} has "
                          f"{free / 2**30:.2f} GiB free; cut the base into more stages, give this stage fewer "
                          "layers (an explicit split) or free the device")


def cut_stage(base: BaseModel, split: list[int], stage: int, device: torch.device | None = None) -> StageModel:
    """Keep stage `stage` of `split` (layer counts per stage) in `base`, move it to `device`, and free the
    rest (moved to `meta`). `base` is changed in place and holds this stage only afterwards."""
    check_stageable(base)
    stages = len(split)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} of a {stages}-stage split")
    decoder = base.decoder
    layers = decoder_layers(decoder)
    if sum(split) != len(layers):
        raise ValueError(f"pipeline split {split} holds {sum(split)} layers; the model has {len(layers)}")
    first_layer = sum(split[:stage])
    own = range(first_layer, first_layer + split[stage])
    embeddings = decoder.get_input_embeddings()
    head = base.model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    first, last = stage == 0, stage == stages - 1
    for index, layer in enumerate(layers):
        if index not in own:
            layer.to("meta")
    if not first and not (last and tied):
        embeddings.to("meta")
    if not last:
        decoder.norm.to("meta")
        if not (first and tied):
            head.to("meta")
    if device is not None:
        rotary = [decoder.rotary_emb] if hasattr(decoder, "rotary_emb") else []
        kept = [layers[index] for index in own] + rotary + ([embeddings] if first or (last and tied) else []) \
            + ([decoder.norm, head] if last else [])
        check_stage_fits(stage, _bytes(kept), device)
        for module in [layers[index] for index in own] + rotary:
            module.to(device)
        if first or (last and tied):
            embeddings.to(device)
        if last:
            decoder.norm.to(device)
            head.to(device)
        base.device = device
    view = copy.copy(decoder)
    view.config = copy.copy(decoder.config)   # per-layer settings indexed from the stage's first layer
    view.config.num_hidden_layers = split[stage]
    if getattr(decoder.config, "layer_types", None):
        view.config.layer_types = list(decoder.config.layer_types[first_layer:first_layer + split[stage]])
    view._modules = dict(decoder._modules)
    view._modules["layers"] = nn.ModuleList([layers[index] for index in own])
    if not last:
        view._modules["norm"] = nn.Identity()
    return StageModel(base=base, stage=stage, stages=stages, first_layer=first_layer, layers=split[stage], view=view)
