"""One LoRA adapter's arithmetic on one linear layer: plain LoRA and PEFT's variants DoRA and PiSSA / OLoRA.

The adapter (`LoraAdapter`, in float32 by default) says how each kind computes, as PEFT; beside it, what the
variants read of the base layer: its weight (dequantized for a bitsandbytes layer), its product without the
bias, and PiSSA's / OLoRA's initial factors of it (`principal_factors`).

Each adapter owns its dropout random generator, so a job's dropout masks do not depend on which other jobs
share its steps (isolation holds with dropout too)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine import lora_masters
from actors.spec.lora_config import LoraConfig


class LoraAdapter(nn.Module):
    """One adapter on one linear layer y = W x + b: delta(x) = B(A(dropout(x))) * scaling, in float32 by
    default. The adapter kinds of PEFT's LoraConfig (same arithmetic, checked against PEFT):
    - init "pissa" / "pissa_niter_N" / "olora": A and B start at W's principal part (its top-r singular
      triplets / its QR factors). PEFT then rewrites the base to W_res = W - scaling * B0 A0; here the base is
      shared by every job and stays W, and the adapter subtracts its own frozen initial product instead:
      delta(x) = scaling * (B A dropout(x) - B0 A0 x), which is PEFT's forward on W_res. B0, A0 are buffers
      (`lora_B0`, `lora_A0`), saved with the adapter (as the rank-2r LoRA [B, -B0] [A; A0] PEFT converts to).
    - use_dora: a trainable magnitude m per output row (initialised to the row norms of W_res + scaling B A,
      as PEFT), the update rescaled row by row by m / ||W_res + scaling B A|| (the norm detached, as PEFT;
      on a quantized base, of the dequantized W, as PEFT):
      delta(x) = (m/n - 1) W_res x' + (m/n) scaling B A x', with x' = dropout(x); without dropout W x' is
      the base layer's own output (no second product); with it, W x' is recomputed on the job's tokens
      (PEFT's form)."""

    def __init__(self, in_features: int, out_features: int, config: LoraConfig, *, generator: torch.Generator,
                 device: torch.device, dtype: torch.dtype = torch.float32, base_weight: torch.Tensor | None = None,
                 seed: int = 0):
        super().__init__()
        self.r = config.r
        self.scaling = config.scaling
        self.dropout = config.dropout
        self.use_dora = config.use_dora
        init = config.init_lora_weights
        lora_a = self.initial_a(config, in_features, generator, dtype)
        lora_b = torch.zeros(out_features, config.r, dtype=dtype)
        initial: tuple[torch.Tensor, torch.Tensor] | None = None
        if lora_a is None:
            if base_weight is None:
                raise ValueError(f"lora.init_lora_weights '{init}' needs the base layer's weight")
            b0, a0 = principal_factors(base_weight, config, seed=seed)
            lora_a, lora_b = a0.to(dtype), b0.to(dtype)
            initial = (a0, b0)
        self.lora_A = nn.Parameter(lora_a.to(device))
        self.lora_B = nn.Parameter(lora_b.to(device))
        self.lora_A0: torch.Tensor | None
        self.lora_B0: torch.Tensor | None
        if initial is None:
            self.lora_A0 = self.lora_B0 = None
        else:
            self.register_buffer("lora_A0", initial[0].to(device, dtype).clone())
            self.register_buffer("lora_B0", initial[1].to(device, dtype).clone())
        self.magnitude: nn.Parameter | None = None
        if self.use_dora:
            if base_weight is None:
                raise ValueError("lora.use_dora needs the base layer's weight")
            with torch.no_grad():
                self.magnitude = nn.Parameter(self._weight_norm(base_weight))
        self.dropout_generator: torch.Generator | None = None
        # (its job's `lora_masters.MasterPool`, A's start, B's start): A and B as views of that pool's flat tensor
        self.master_pool: tuple[lora_masters.MasterPool, int, int] | None = None

    @staticmethod
    def initial_a(config: LoraConfig, in_features: int, generator: torch.Generator,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """A's initial value drawn from `generator` (PEFT's default: Kaiming-uniform; "gaussian"), or None
        for the kinds initialised from the base weight (PiSSA / OLoRA), which draw nothing from it."""
        lora_a = torch.empty(config.r, in_features, dtype=dtype)
        if config.init_lora_weights == "default":
            # PEFT's default initialisation: A Kaiming-uniform, B zero (so the adapter starts as a no-op)
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
        elif config.init_lora_weights == "gaussian":
            nn.init.normal_(lora_a, std=1 / config.r, generator=generator)
        else:
            return None
        return lora_a

    @property
    def plain(self) -> bool:
        """Plain LoRA (no DoRA, no frozen initial product): the only kind the grouped way computes."""
        return not self.use_dora and self.lora_A0 is None

    @property
    def drops(self) -> bool:
        return self.training and self.dropout > 0

    def draw_dropout_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """Fill `keep` (this job's tokens x in_features) with this adapter's next inverted-dropout mask,
        from its own generator: the same draws whichever way the update is computed."""
        return keep.bernoulli_(1.0 - self.dropout, generator=self.dropout_generator).div_(1.0 - self.dropout)

    def _residual_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """W_res: the base weight less the frozen initial product (PiSSA / OLoRA), in the adapter's dtype."""
        weight = weight.to(self.lora_A.dtype)
        if self.lora_A0 is not None:
            weight = weight - (self.scaling * self.lora_B0) @ self.lora_A0
        return weight

    def _weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """DoRA's ||W_res + scaling B A||, row by row (no gradient: PEFT detaches it)."""
        with torch.no_grad():
            combined = self._residual_weight(weight) + self.scaling * (self.lora_B @ self.lora_A)
            return torch.linalg.norm(combined, dim=1).to(self.lora_A.dtype)

    def _initial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A0), self.lora_B0) * self.scaling

    def delta(self, x: torch.Tensor, base_out: torch.Tensor | None = None, base: nn.Module | None = None
              ) -> torch.Tensor:
        """The update on these tokens `x`; `base_out` (the base layer's output on them) and `base` (the base
        layer) are read by DoRA only."""
        input_dtype = x.dtype
        x = x.to(self.lora_A.dtype)
        dropped = x * self.draw_dropout_mask(torch.empty_like(x)) if self.drops else x
        update = F.linear(F.linear(dropped, self.lora_A), self.lora_B)
        initial = self._initial(x) if self.lora_A0 is not None else None
        if not self.use_dora:
            update = update * self.scaling
            return update if initial is None else update - initial
        if base_out is None or base is None:
            raise ValueError("a DoRA adapter's update needs the base layer and its output")
        scale = (self.magnitude / self._weight_norm(base_weight(base))).view(1, -1)
        if self.drops:   # PEFT's form: W_res on the dropped input, computed again
            base_result = _base_product(base, dropped.to(input_dtype)).to(update.dtype)
            if initial is not None:
                base_result = base_result - self._initial(dropped)
        else:
            base_result = base_out.to(update.dtype)
            if base.bias is not None:
                base_result = base_result - base.bias.to(update.dtype)
            if initial is not None:
                base_result = base_result - initial
        update = (scale - 1) * base_result + scale * update * self.scaling
        return update if initial is None else update - initial


def _base_product(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """W x without the bias, in the base's own arithmetic: F.linear with the weight itself, so that backward
    keeps no float32 copy of it; a quantized layer's own product (bitsandbytes dequantizes in its backward)
    less its bias. (PEFT multiplies by the dequantized weight in the adapter's dtype: the same on a float32
    base; on a bfloat16 or quantized one, another rounding.)"""
    if full_precision(base):
        return F.linear(x.to(base.weight.dtype), base.weight)
    out = base(x)
    return out if base.bias is None else out - base.bias.to(out.dtype)


def full_precision(module: nn.Module) -> bool:
    """A plain float linear layer (not bitsandbytes' Linear8bitLt / Linear4bit)."""
    weight = module.weight
    return (type(weight).__name__ not in ("Params4bit", "Int8Params")
            and weight.dtype in (torch.float32, torch.float16, torch.bfloat16))


def base_weight(base: nn.Module) -> torch.Tensor:
    """The base layer's weight W (out, in) in floating point: itself, or for a bitsandbytes layer its
    dequantized copy (as PEFT's dequantize_module_weight: NF4 through dequantize_4bit, int8 rows times
    their absmax / 127), which DoRA's row norms read."""
    weight = base.weight
    kind = type(weight).__name__
    if kind not in ("Params4bit", "Int8Params"):
        return weight
    import bitsandbytes as bnb

    if kind == "Params4bit":
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    scales = getattr(getattr(base, "state", None), "SCB", None)
    if scales is None:
        scales = weight.SCB
    return bnb.functional.int8_vectorwise_dequant(weight.data, scales.to(weight.data.device))


def principal_factors(weight: torch.Tensor, config: LoraConfig, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B0, A0) of PiSSA or OLoRA for the base weight W (out, in), in float32, as PEFT computes them
    (LoraLayer.pissa_init / olora_init): PiSSA: W's top-r singular triplets, sqrt(S / scaling) into each
    factor; pissa_niter_N: the same from torch.svd_lowrank with N iterations (its random draws seeded with
    the job's seed); OLoRA: Q's first r columns and R's first r rows of W = QR."""
    init, r = config.init_lora_weights, config.r
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"lora.init_lora_weights '{init}' needs a floating-point base weight, not {weight.dtype} "
                         "(a quantized base: set quantization: none, or init_lora_weights: default)")
    out_features, in_features = weight.shape
    if r > min(out_features, in_features):
        raise ValueError(f"lora.r {r} exceeds the rank of a {out_features}x{in_features} layer, which "
                         f"init_lora_weights '{init}' decomposes; use r <= {min(out_features, in_features)} or "
                         "narrower target_modules")
    weight = weight.detach().to(torch.float32)
    if init == "olora":
        q, rr = torch.linalg.qr(weight)
        return q[:, :r].contiguous(), rr[:r].contiguous()
    if init == "pissa":
        v, s, uh = torch.linalg.svd(weight, full_matrices=False)
        vr, sr, uhr = v[:, :r], s[:r] / config.scaling, uh[:r]
    else:   # pissa_niter_N
        devices = [weight.device] if weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            vr, sr, ur = torch.svd_lowrank(weight, r, niter=int(init.rsplit("_", 1)[-1]))
        sr, uhr = sr / config.scaling, ur.t()
    root = torch.diag(torch.sqrt(sr))
    return (vr @ root).contiguous(), (root @ uhr).contiguous()
