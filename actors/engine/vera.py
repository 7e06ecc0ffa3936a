"""VeRA adapters (`lora.kind: vera`, PEFT's VeraConfig): one pair of frozen random projections A (r, in) and
B (out, r) per job, shared by all the layers it adapts, and per layer two trainable scaling vectors:
delta(x) = lambda_b * (B[:out] (lambda_d * (A[:, :in] dropout(x)))), with lambda_b (out) starting at zero
(the adapter starts as a no-op) and lambda_d (r) at `d_initial`.

As PEFT's VeraModel: the projections are sized for the largest input and output dimensions over the
adapted layers (each layer reads its top-left slice), drawn Kaiming-uniform (gain sqrt(2), fan-in) from a
CPU generator seeded with `projection_prng_key`, A first, then B. Jobs whose projections are the same
(same key, rank and dimensions) share one copy on the device; a projection is never written to, so sharing
changes no job's arithmetic. A VeRA adapter always computes on its own job's token segment (never the
grouped way of plain LoRA), so it fuses with any other adapter kind exactly as it runs alone."""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from actors.spec.lora_config import LoraConfig


def kaiming_projection(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """PEFT's `vera.model._kaiming_init` on a new float32 tensor: uniform in +-sqrt(3) sqrt(2) / sqrt(fan_in),
    fan_in being the second dimension, drawn from `generator`."""
    bound = math.sqrt(3.0) * math.sqrt(2) / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class VeraProjections:
    """A job's frozen projections: `vera_A` (r, largest in), `vera_B` (largest out, r), float32 (the dtype
    PEFT draws and saves them in)."""

    def __init__(self, vera_a: torch.Tensor, vera_b: torch.Tensor):
        self.vera_A = vera_a
        self.vera_B = vera_b

    @staticmethod
    def dimensions(shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """(largest in, largest out) over the (in, out) shapes of the adapted layers (PEFT's `_find_dim`)."""
        if not shapes:
            raise ValueError("lora.target_modules matches no linear layer for VeRA's projections")
        return max(fan_in for fan_in, _ in shapes), max(fan_out for _, fan_out in shapes)

    @classmethod
    def generate(cls, config: LoraConfig, shapes: list[tuple[int, int]], device: torch.device) -> VeraProjections:
        """The projections PEFT draws for `config` over layers of these shapes, on `device`; shared with any
        other job's identical ones (held while some adapter holds them)."""
        largest_in, largest_out = cls.dimensions(shapes)
        key = (config.projection_prng_key, config.r, largest_in, largest_out, str(device))
        shared = _SHARED.get(key)
        if shared is not None:
            return shared
        generator = torch.Generator(device="cpu").manual_seed(config.projection_prng_key)
        vera_a = kaiming_projection((config.r, largest_in), generator)
        vera_b = kaiming_projection((largest_out, config.r), generator)
        made = cls(vera_a.to(device), vera_b.to(device))
        _SHARED[key] = made
        return made

    def equals(self, vera_a: torch.Tensor, vera_b: torch.Tensor) -> bool:
        return (tuple(vera_a.shape) == tuple(self.vera_A.shape) and tuple(vera_b.shape) == tuple(self.vera_B.shape)
                and torch.equal(vera_a.to(self.vera_A.device, torch.float32), self.vera_A)
                and torch.equal(vera_b.to(self.vera_B.device, torch.float32), self.vera_B))


_SHARED: weakref.WeakValueDictionary[tuple, VeraProjections] = weakref.WeakValueDictionary()


class VeraAdapter(nn.Module):
    """One VeRA adapter on one linear layer (in, out): trainable `vera_lambda_b` (out) and `vera_lambda_d`
    (r), the job's shared projections read through slices (module docstring). The attributes the fused
    layer and the trainer read of any adapter (`r`, `plain`, `drops`, `dropout_generator`, `lora_A0`,
    `magnitude`, `delta`) as LoraAdapter has them."""

    plain = False          # never the grouped way: its own segment only
    use_dora = False
    lora_A0 = None         # no frozen initial product
    lora_B0 = None
    magnitude = None

    def __init__(self, in_features: int, out_features: int, config: LoraConfig, projections: VeraProjections, *,
                 device: torch.device, dtype: torch.dtype = torch.float32):
        super().__init__()
        largest_in, largest_out = projections.vera_A.shape[1], projections.vera_B.shape[0]
        if in_features > largest_in or out_features > largest_out:
            raise ValueError(f"a {in_features}x{out_features} layer exceeds VeRA's {largest_in}x{largest_out} "
                             "projections")
        self.r = config.r
        self.in_features, self.out_features = in_features, out_features
        self.dropout = config.dropout
        self.projections = projections
        # PEFT's reset_vera_parameters: lambda_d filled with d_initial, lambda_b zero
        self.vera_lambda_b = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        self.vera_lambda_d = nn.Parameter(torch.full((config.r,), config.d_initial, dtype=dtype, device=device))
        self.dropout_generator: torch.Generator | None = None

    @property
    def drops(self) -> bool:
        return self.training and self.dropout > 0

    def draw_dropout_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """This adapter's next inverted-dropout mask, from its own generator (as LoraAdapter's)."""
        return keep.bernoulli_(1.0 - self.dropout, generator=self.dropout_generator).div_(1.0 - self.dropout)

    def delta(self, x: torch.Tensor, base_out: torch.Tensor | None = None, base: nn.Module | None = None
              ) -> torch.Tensor:
        """The update on these tokens `x` (PEFT's VeRA Linear.forward, in the adapter's dtype)."""
        x = x.to(self.vera_lambda_d.dtype)
        dropped = x * self.draw_dropout_mask(torch.empty_like(x)) if self.drops else x
        vera_a = self.projections.vera_A[:, :self.in_features].to(x.dtype)
        vera_b = self.projections.vera_B[:self.out_features, :].to(x.dtype)
        return self.vera_lambda_b * F.linear(self.vera_lambda_d * F.linear(dropped, vera_a), vera_b)
