"""Fused multi-LoRA linear layers: the base projection runs once over every token of the fused step;
each adapter's low-rank update runs only on its own job's contiguous token segment.

Ways to compute the adapters' updates, with the same arithmetic per job:
- per segment: each adapter's two small matrix products on its job's slice of the stream (the least
  arithmetic; a handful of kernel launches per adapter and layer);
- grouped (actors/engine/lora_grouped.py): every plain adapter in a few batched products per layer, whatever
  the number of jobs;
- the CUDA path (actors/engine/lora_cuda.py): the base product and the plain adapters' updates in the base's
  dtype, in one autograd function.

DoRA and PiSSA / OLoRA adapters (actors/engine/lora_adapter.py) and VeRA adapters (actors/engine/vera.py)
always take the per-segment way, beside grouped plain adapters: the base projection still runs once for every
token, and their corrections touch their own job's tokens only."""

from __future__ import annotations

import torch
from torch import nn

from actors.engine import lora_cuda, lora_grouped
from actors.engine.layout import StepLayout, current_layout, parts
from actors.engine.lora_adapter import full_precision


class JobAdapters(nn.ModuleDict):
    """A layer's adapters by job name, held under `job_<name>`: a job may be named like a module attribute
    ('train', 'half', 'cuda', 'forward'), which nn.ModuleDict refuses as a key."""

    PREFIX = "job_"

    def __init__(self) -> None:
        super().__init__()
        self.version = 0   # changes with every adapter added or removed (`FusedLoraLinear`'s per-step lookup)

    def __getitem__(self, name: str) -> nn.Module:
        return super().__getitem__(self.PREFIX + name)

    def __setitem__(self, name: str, module: nn.Module) -> None:
        module.train(self.training)   # an adapter joins in its layer's mode (`set_adapters_training` relies on it)
        super().__setitem__(self.PREFIX + name, module)
        self.version += 1

    def __delitem__(self, name: str) -> None:
        super().__delitem__(self.PREFIX + name)
        self.version += 1

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(self.PREFIX + name)

    def keys(self) -> list[str]:
        return [key[len(self.PREFIX):] for key in super().keys()]

    def __iter__(self):
        return iter(self.keys())

    def items(self) -> list[tuple[str, nn.Module]]:
        return [(key[len(self.PREFIX):], module) for key, module in super().items()]


class FusedLoraLinear(nn.Module):
    """Wraps a frozen linear layer; holds the adapters of every job that targets it.

    `base` and `adapters` are registered submodules (state dicts, `.to()`, `.modules()` see them) and also plain
    instance attributes: nn.Module finds a submodule through its Python `__getattr__`, a call per lookup, and a
    fused step looks these up a dozen times per layer (on the 8B shape ~2,000 calls a step of the host)."""

    FAST = ("base", "adapters")

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in self.FAST:
            self.__dict__[name] = value   # found before nn.Module's __getattr__ is asked

    def __delattr__(self, name: str) -> None:
        if name in self.FAST:
            self.__dict__.pop(name, None)
        super().__delattr__(name)

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.adapters = JobAdapters()
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        self._present: tuple | None = None   # (its key, what `_jobs_in` found for it)
        self.siblings = None   # the wrapped layers of its parent reading its input (lora_siblings.SiblingSet)

    @property
    def weight(self) -> torch.Tensor:
        """The frozen layer's weight, for model code that reads it (HunYuan-MoE's router checks its dtype), as
        PEFT's layers give it."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def _jobs_in(self, layout: StepLayout) -> tuple[list, list, list[tuple[int, int]], list, bool]:
        """(the adapters present in the step with their bounds, the plain ones, their bounds, the other ones with
        their bounds, whether the plain ones' masters are float32). Kept from step to step while the step's jobs,
        this layer's adapters and their mode stay the same (only the bounds are the step's): a lookup per job and
        layer and step was a large part of a fused step's host time at many jobs. Made once a step (the layers
        reading one input ask again: actors/engine/lora_siblings.py)."""
        memo = ("jobs-in", id(self), self.adapters.version, self.adapters.training)
        made = layout.tensors.get(memo)
        if made is not None:
            return made
        segments = layout.segments
        names = layout.tensors.get("segment-names")
        if names is None:
            names = layout.tensors["segment-names"] = tuple([(name, end > start) for name, start, end in segments])
        key = (names, self.adapters.version, self.adapters.training)
        found = self._present
        if found is None or found[0] != key:
            places = [place for place, (name, start, end) in enumerate(segments)
                      if name in self.adapters and end > start]
            adapters = [self.adapters[segments[place][0]] for place in places]
            plain = [index for index, adapter in enumerate(adapters) if adapter.plain]
            others = [index for index, adapter in enumerate(adapters) if not adapter.plain]
            float32 = all(adapters[index].lora_A.dtype == torch.float32 for index in plain)
            found = self._present = (key, (places, adapters, plain, others, float32))
        places, adapters, plain, rest, float32 = found[1]
        bounds = [segments[place][1:] for place in places]
        made = layout.tensors[memo] = (
            list(zip(adapters, bounds, strict=True)), [adapters[index] for index in plain],
            [bounds[index] for index in plain], [(adapters[index], bounds[index]) for index in rest], float32)
        return made

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = current_layout()
        if layout is None or len(self.adapters) == 0:
            return self.base(x)
        if self.siblings is not None:   # computed with a sibling layer that read this input first
            taken = self.siblings.taken(self, x, layout)
            if taken is not None:
                return taken.view(*x.shape[:-1], self.out_features)
        present, plain_adapters, plain_bounds, rest, float32 = self._jobs_in(layout)
        if not present:
            return self.base(x)
        flat_x = x.reshape(-1, x.shape[-1])
        if lora_cuda.takes(plain_adapters, flat_x, float32):
            # the CUDA path (actors/engine/lora_cuda.py): the base product and the plain adapters' updates in
            # the base's dtype, in one autograd function, with the layers reading the same input where they fit
            # (actors/engine/lora_siblings.py); the other kinds add their updates below
            flat_out = None
            if self.siblings is not None and not rest:
                flat_out = self.siblings.output(self, x, flat_x, layout)
            if flat_out is None:
                flat_out = lora_cuda.linear_with_adapters(self.base, full_precision(self.base), flat_x,
                                                          plain_adapters, plain_bounds, layout)
            out = flat_out.view(*x.shape[:-1], self.out_features)
            return out if not rest else out + self._segment_deltas(rest, flat_x, flat_out, out.dtype).view(out.shape)
        out = self.base(x)
        num_tokens = flat_x.shape[0]
        plain = list(zip(plain_adapters, plain_bounds, strict=True))
        per_segment = present   # every adapter on its own segment, unless the plain ones are grouped
        grouped: torch.Tensor | None = None
        if plain and lora_grouped.use_grouping(plain_adapters, plain_bounds, flat_x):
            adapters, bounds = plain_adapters, plain_bounds
            order = lora_grouped.rank_order(adapters)
            group = lora_grouped.SegmentGroup.of(layout, tuple(bounds[index] for index in order), flat_x.device)
            grouped = lora_grouped.grouped_delta([adapters[index] for index in order], group, flat_x, x).to(out.dtype)
            per_segment = rest   # the other kinds only
            if not per_segment:
                return (out.view(grouped.shape) + grouped).view(out.shape)
        delta = self._segment_deltas(per_segment, flat_x, out.reshape(-1, self.out_features), out.dtype)
        if grouped is not None:   # the grouped rows are zeros on the other adapters' tokens, and vice versa
            delta = grouped.reshape(num_tokens, self.out_features) + delta
        return out + delta.view(out.shape)

    def _segment_deltas(self, adapters: list[tuple[nn.Module, tuple[int, int]]], flat_x: torch.Tensor,
                        flat_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each adapter's update on its own segment (adapter.delta), zeros elsewhere: (tokens, out_features)."""
        num_tokens = flat_x.shape[0]
        pieces: list[torch.Tensor] = []
        position = 0
        bounds = [bound for _, bound in adapters]
        for (adapter, (start, end)), x, out in zip(adapters, parts(flat_x, bounds), parts(flat_out, bounds),
                                                   strict=True):
            if start > position:
                pieces.append(flat_out.new_zeros(start - position, self.out_features, dtype=dtype))
            pieces.append(adapter.delta(x, out, self.base).to(dtype))
            position = end
        if position < num_tokens:
            pieces.append(flat_out.new_zeros(num_tokens - position, self.out_features, dtype=dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
