"""Fused multi-LoRA linear layers: the base projection runs once over every token of the fused step;
each adapter's low-rank update runs only on its own job's contiguous token segment.

Two ways to compute the adapters' updates, with the same arithmetic per job:
- per segment: each adapter's two small matrix products on its job's slice of the stream (the least
  arithmetic; a handful of kernel launches per adapter and layer);
- grouped (on CUDA, where a step of a small model is bound by kernel launches, not arithmetic): the jobs'
  token slices gathered into one padded (jobs, longest slice, features) batch and every adapter run in
  two batched products (`torch.bmm`) per distinct rank (adapters of equal rank stacked together), then
  the real rows brought back: the same few launches per layer whatever the number of jobs (a job with
  dropout adds its own mask draw, from its own generator). Each job's batch row holds only its own
  tokens (a shorter job's row is padded with its own first token, and the padding's results are never
  read back), so no job's arithmetic, forward or backward, touches another job's tokens: the isolation
  argument of the per-segment way holds unchanged, even if another job's activations are inf or NaN.
  Used (auto) on CUDA when at least two adapters take part and padding at most doubles the rows;
  GROUPING = "grouped" forces it for any number of adapters (tests, benchmarks, the operation count).

DoRA and PiSSA / OLoRA adapters (LoraAdapter says how they compute, as PEFT) and VeRA adapters
(actors/engine/vera.py) always take the per-segment way, beside grouped plain adapters: the base projection
still runs once for every token, and their
corrections touch their own job's tokens only.

Adapters are added and removed at run time. Each adapter owns its dropout random generator, so a job's
dropout masks do not depend on which other jobs share its steps (isolation holds with dropout too)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from actors.engine import lora_cuda
from actors.engine.layout import StepLayout, current_layout
from actors.engine.lora_targets import match_targets, peft_target_modules
from actors.engine.vera import VeraAdapter, VeraProjections
from actors.spec.lora_config import LoraConfig, needs_full_precision_base


def _is_linear(module: nn.Module) -> bool:
    # nn.Linear, and bitsandbytes' Linear8bitLt / Linear4bit (nn.Linear subclasses)
    return isinstance(module, nn.Linear)


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
        # (its job's `lora_cuda.MasterPool`, A's start, B's start): A and B as views of that pool's flat tensor
        self.master_pool: tuple[lora_cuda.MasterPool, int, int] | None = None

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
    if _full_precision(base):
        return F.linear(x.to(base.weight.dtype), base.weight)
    out = base(x)
    return out if base.bias is None else out - base.bias.to(out.dtype)


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


# "auto": grouped on CUDA, per segment elsewhere; "grouped" / "segments" force one way (tests, benchmarks)
GROUPING: Literal["auto", "grouped", "segments"] = "auto"
MAX_GROUP_PADDING = 2.0   # grouped only while the padded batch has at most this many times the real rows


class SegmentGroup:
    """Index tensors, built once per step, that gather the given token segments into a (segments, longest,
    features) batch (rows in the order the segments are given, which need not be stream order) and bring
    the batch's real rows back to the stream. A shorter segment's row is padded with copies of its own
    first token, so every row reads its own job's tokens only; the padding rows' results are never read
    back, so their gradients are exact zeros. Tokens outside the segments (a job with no adapter on this
    layer) get a zero row. Built with numpy and copied to the device once: no tensor operation per job."""

    def __init__(self, bounds: tuple[tuple[int, int], ...], num_tokens: int, device: torch.device):
        starts = np.array([start for start, _ in bounds], dtype=np.int64)
        lengths = np.array([end - start for start, end in bounds], dtype=np.int64)
        self.lengths = lengths.tolist()
        self.longest = int(lengths.max())
        self.count = len(bounds)
        column = np.arange(self.longest, dtype=np.int64)[None, :]
        gather = np.where(column < lengths[:, None], starts[:, None] + column, starts[:, None])
        # the real rows in stream order: (row, position) of each token of each segment, segments by start
        order = np.argsort(starts, kind="stable")
        ordered_lengths = lengths[order]
        covered = int(lengths.sum())
        offsets = np.cumsum(ordered_lengths) - ordered_lengths
        row_of = np.repeat(order, ordered_lengths)
        position_of = np.arange(covered, dtype=np.int64) - np.repeat(offsets, ordered_lengths)
        # where the segments do not cover the stream end to end: each token's real row, or the zero row
        # appended after the `covered` real rows
        self.scatter: torch.Tensor | None = None
        token_of = starts[row_of] + position_of
        if covered != num_tokens or not np.array_equal(token_of, np.arange(num_tokens)):
            scatter = np.full(num_tokens, covered, dtype=np.int64)
            scatter[token_of] = np.arange(covered, dtype=np.int64)
            self.scatter = torch.from_numpy(scatter).to(device)
        # segments of one length, back to back in row order from the stream's start: the batch is a view of
        # the stream and the result a reshape (no gathering, no index backward)
        self.regular = (self.scatter is None and bool((lengths == self.longest).all())
                        and np.array_equal(starts, np.arange(self.count) * self.longest))
        self.gather = torch.from_numpy(gather).to(device)
        self.row_of = torch.from_numpy(row_of).to(device)
        self.position_of = torch.from_numpy(position_of).to(device)
        self.device = device
        self.per_row: dict[tuple, torch.Tensor] = {}
        self.input_rows: tuple | None = None   # (input, its version, dtype, rows): `_input_rows`

    def row_values(self, values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
        """One value per row (the adapters' scalings, their dropout keep probabilities) as a (segments, 1, 1)
        tensor on the device (one copy per step)."""
        key = (values, dtype)
        if key not in self.per_row:
            self.per_row[key] = torch.tensor(values, dtype=dtype).view(-1, 1, 1).to(self.device)
        return self.per_row[key]

    @staticmethod
    def of(layout: StepLayout, bounds: tuple[tuple[int, int], ...], device: torch.device) -> SegmentGroup:
        key = ("segment-group", bounds, str(device))
        if key not in layout.tensors:
            layout.tensors[key] = SegmentGroup(bounds, layout.num_tokens, device)
        return layout.tensors[key]


def _use_grouping(adapters: list[LoraAdapter], bounds: list[tuple[int, int]], x: torch.Tensor) -> bool:
    if GROUPING == "segments" or len({adapter.lora_A.dtype for adapter in adapters}) > 1:
        return False
    if GROUPING == "grouped":
        return True
    if len(adapters) < 2:
        return False
    longest = max(end - start for start, end in bounds)
    return x.is_cuda and len(bounds) * longest <= MAX_GROUP_PADDING * sum(end - start for start, end in bounds)


def rank_order(adapters: list[LoraAdapter]) -> list[int]:
    """The adapters' indices with equal ranks next to each other (stable): the grouped way's row order."""
    return sorted(range(len(adapters)), key=lambda index: adapters[index].r)


def _stacked(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The parameters stacked on a new first dimension: a view for one (no operation), else one stack."""
    return parameters[0].unsqueeze(0) if len(parameters) == 1 else torch.stack(parameters)


def _input_rows(group: SegmentGroup, flat_x: torch.Tensor, source: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """The group's (jobs, longest, in) batch of the input in the adapters' dtype. Layers that read the same
    input tensor one after another (q, k and v; gate and up) share one: one cast and gather, and one copy
    held for the backward instead of one per layer (on a GPU with bf16 layers and float32 adapters these
    copies were ~5 of the ~13 MB a token of a Llama-3.1-8B-shaped step). The group keeps the last input it
    was given (a reference to it: its memory cannot be reused while the entry stands) and its version, so
    an input changed in place or another tensor is never taken for it."""
    cached = group.input_rows
    if (source is not None and cached is not None and cached[0] is source and cached[1] == source._version
            and cached[2] == dtype):
        return cached[3]
    flat_x = flat_x.to(dtype)
    if group.regular:
        rows = flat_x.view(group.count, group.longest, flat_x.shape[-1])
    else:
        rows = flat_x[group.gather]                         # (jobs, longest, in)
    group.input_rows = None if source is None else (source, source._version, dtype, rows)
    return rows


def _grouped_delta(adapters: list[LoraAdapter], group: SegmentGroup, flat_x: torch.Tensor,
                   source: torch.Tensor | None = None) -> torch.Tensor:
    """Every adapter's update on its own segment: (tokens, out_features), or for a regular group
    (jobs, longest, out_features) in stream order, not contiguous. `adapters` are in the group's row
    order with equal ranks adjacent (`rank_order`): one pair of batched products per distinct rank, so the
    operations per layer grow with the number of distinct ranks, never with the number of adapters.
    `source`: the layer's input tensor that `flat_x` views (its rows are shared with the layers before it
    that read the same tensor: `_input_rows`)."""
    dtype = adapters[0].lora_A.dtype
    rows = _input_rows(group, flat_x, source, dtype)
    if any(adapter.drops for adapter in adapters):
        # each adapter draws its own mask from its own generator (isolation); the padding rows and the jobs
        # without dropout keep ones; one division by the keep probabilities gives every mask its scale
        keep = torch.ones_like(rows)
        for index, (adapter, length) in enumerate(zip(adapters, group.lengths, strict=True)):
            if adapter.drops:
                keep[index, :length].bernoulli_(1.0 - adapter.dropout, generator=adapter.dropout_generator)
        probabilities = tuple(1.0 - adapter.dropout if adapter.drops else 1.0 for adapter in adapters)
        rows = rows * keep.div_(group.row_values(probabilities, dtype))
    scalings = group.row_values(tuple(adapter.scaling for adapter in adapters), dtype)
    updates = []
    start = 0
    while start < len(adapters):
        end = start
        while end < len(adapters) and adapters[end].r == adapters[start].r:
            end += 1
        bucket = adapters[start:end]
        lora_a = _stacked([a.lora_A for a in bucket])                                     # (jobs, rank, in)
        lora_b = _stacked([a.lora_B for a in bucket])                                     # (jobs, out, rank)
        # Products in the (features, tokens) orientation: the gradients of the stacked A and B then come out
        # in the parameters' own (rank, in) / (out, rank) layout, so each adapter's gradient is a view
        # autograd keeps as it is, where the (tokens, features) orientation made it copy every one (2 copies
        # per adapter and layer in each backward: on a GPU, launches that grew with the number of jobs).
        hidden = torch.bmm(lora_a, rows[start:end].transpose(1, 2))                       # (jobs, rank, longest)
        updates.append(torch.bmm(lora_b, hidden) * scalings[start:end])                    # (jobs, out, longest)
        start = end
    update = updates[0] if len(updates) == 1 else torch.cat(updates)
    if group.regular:   # (jobs, longest, out), strided: the caller's addition reads it as it lies
        return update.transpose(1, 2)
    real = update.transpose(1, 2)[group.row_of, group.position_of]                        # (real rows, out)
    if group.scatter is None:                                                             # stream order
        return real
    return F.pad(real, (0, 0, 0, 1))[group.scatter]                                       # zeros elsewhere


class JobAdapters(nn.ModuleDict):
    """A layer's adapters by job name, held under `job_<name>`: a job may be named like a module attribute
    ('train', 'half', 'cuda', 'forward'), which nn.ModuleDict refuses as a key."""

    PREFIX = "job_"

    def __getitem__(self, name: str) -> nn.Module:
        return super().__getitem__(self.PREFIX + name)

    def __setitem__(self, name: str, module: nn.Module) -> None:
        super().__setitem__(self.PREFIX + name, module)

    def __delitem__(self, name: str) -> None:
        super().__delitem__(self.PREFIX + name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(self.PREFIX + name)

    def keys(self) -> list[str]:
        return [key[len(self.PREFIX):] for key in super().keys()]

    def __iter__(self):
        return iter(self.keys())

    def items(self) -> list[tuple[str, nn.Module]]:
        return [(key[len(self.PREFIX):], module) for key, module in super().items()]


class FusedLoraLinear(nn.Module):
    """Wraps a frozen linear layer; holds the adapters of every job that targets it."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.adapters = JobAdapters()
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = current_layout()
        if layout is None or len(self.adapters) == 0:
            return self.base(x)
        present = [(self.adapters[name], (start, end)) for name, start, end in layout.segments
                   if name in self.adapters and end > start]
        if not present:
            return self.base(x)
        plain = [(adapter, bounds) for adapter, bounds in present if adapter.plain]
        flat_x = x.reshape(-1, x.shape[-1])
        if lora_cuda.takes([adapter for adapter, _ in plain], flat_x):
            # the CUDA path (actors/engine/lora_cuda.py): the base product and the plain adapters' updates in
            # the base's dtype, in one autograd function; the other kinds add their updates below
            flat_out = lora_cuda.linear_with_adapters(self.base, _full_precision(self.base), flat_x,
                                                      [adapter for adapter, _ in plain],
                                                      [bounds for _, bounds in plain], layout)
            rest = [(adapter, bounds) for adapter, bounds in present if not adapter.plain]
            out = flat_out.view(*x.shape[:-1], self.out_features)
            return out if not rest else out + self._segment_deltas(rest, flat_x, flat_out, out.dtype).view(out.shape)
        out = self.base(x)
        num_tokens = flat_x.shape[0]
        rest = present
        grouped: torch.Tensor | None = None
        if plain and _use_grouping([a for a, _ in plain], [b for _, b in plain], flat_x):
            adapters, bounds = [a for a, _ in plain], [b for _, b in plain]
            order = rank_order(adapters)
            group = SegmentGroup.of(layout, tuple(bounds[index] for index in order), flat_x.device)
            grouped = _grouped_delta([adapters[index] for index in order], group, flat_x, x).to(out.dtype)
            rest = [(adapter, bounds) for adapter, bounds in present if not adapter.plain]
            if not rest:
                return (out.view(grouped.shape) + grouped).view(out.shape)
        delta = self._segment_deltas(rest, flat_x, out.reshape(-1, self.out_features), out.dtype)
        if grouped is not None:   # the grouped rows are zeros on the other adapters' tokens, and vice versa
            delta = grouped.reshape(num_tokens, self.out_features) + delta
        return out + delta.view(out.shape)

    def _segment_deltas(self, adapters: list[tuple[nn.Module, tuple[int, int]]], flat_x: torch.Tensor,
                        flat_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each adapter's update on its own segment (adapter.delta), zeros elsewhere: (tokens, out_features)."""
        num_tokens = flat_x.shape[0]
        pieces: list[torch.Tensor] = []
        position = 0
        for adapter, (start, end) in adapters:
            if start > position:
                pieces.append(flat_out.new_zeros(start - position, self.out_features, dtype=dtype))
            pieces.append(adapter.delta(flat_x[start:end], flat_out[start:end], self.base).to(dtype))
            position = end
        if position < num_tokens:
            pieces.append(flat_out.new_zeros(num_tokens - position, self.out_features, dtype=dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the linear layers LoRA may target (the output embedding excluded)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if isinstance(module, FusedLoraLinear):
            names.append(name)
        elif _is_linear(module) and module is not output and not name.endswith(".base"):
            names.append(name)
    return names


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """Module names matched by a LoRA config's `target_modules`, with PEFT's matching rule."""
    return match_targets(linear_module_names(model), target_modules)


def _full_precision(module: nn.Module) -> bool:
    """A plain float linear layer (not bitsandbytes' Linear8bitLt / Linear4bit, whatever it is wrapped in)."""
    if isinstance(module, FusedLoraLinear):
        module = module.base
    weight = module.weight
    return (type(weight).__name__ not in ("Params4bit", "Int8Params")
            and weight.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _on_meta(module: nn.Module) -> bool:
    """A linear layer (wrapped or not) whose weight is on `meta`: held by another pipeline stage."""
    return (module.base if isinstance(module, FusedLoraLinear) else module).weight.is_meta


def _parent_and_child(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _wrap(model: nn.Module, name: str) -> FusedLoraLinear:
    parent, child = _parent_and_child(model, name)
    module = getattr(parent, child)
    if isinstance(module, FusedLoraLinear):
        return module
    fused = FusedLoraLinear(module)
    setattr(parent, child, fused)
    return fused


def _unwrap(model: nn.Module, name: str) -> None:
    parent, child = _parent_and_child(model, name)
    module = getattr(parent, child)
    if isinstance(module, FusedLoraLinear):
        setattr(parent, child, module.base)


class AdapterHandle:
    """The parameters of one job's adapter across all the layers it targets."""

    def __init__(self, name: str, config: LoraConfig, layers: dict[str, LoraAdapter | VeraAdapter],
                 generator: torch.Generator | None, peft_targets: list[str] | None = None,
                 projections: VeraProjections | None = None):
        self.name = name
        self.config = config
        self.layers = layers
        self.dropout_generator = generator
        self.peft_targets = peft_targets if peft_targets is not None else sorted(layers)
        self.projections = projections   # VeRA: the job's frozen projections, shared by its layers

    def use_projections(self, projections: VeraProjections) -> None:
        """Make every layer of this VeRA adapter read `projections` (those of a saved adapter)."""
        self.projections = projections
        for layer in self.layers.values():
            layer.projections = projections

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """The trainable tensors under PEFT's names (adapter name stripped): `<module>.lora_A.weight`,
        `<module>.lora_B.weight` and, with DoRA, `<module>.lora_magnitude_vector`; VeRA's
        `<module>.vera_lambda_b` and `<module>.vera_lambda_d`."""
        for module_name, layer in self.layers.items():
            if isinstance(layer, VeraAdapter):
                yield f"{module_name}.vera_lambda_b", layer.vera_lambda_b
                yield f"{module_name}.vera_lambda_d", layer.vera_lambda_d
                continue
            yield f"{module_name}.lora_A.weight", layer.lora_A
            yield f"{module_name}.lora_B.weight", layer.lora_B
            if layer.magnitude is not None:
                yield f"{module_name}.lora_magnitude_vector", layer.magnitude

    def parameter_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(A's, the others): LoRA+'s two learning-rate groups, as PEFT's create_loraplus_optimizer splits
        them (lora_B and every 1-d parameter, DoRA's magnitudes included, in the second)."""
        first, second = [], []
        for name, parameter in self.named_parameters():
            (first if name.endswith(".lora_A.weight") else second).append(parameter)
        return first, second

    def frozen_initial(self) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
        """(module, A0, B0) of every layer with a frozen initial product (PiSSA / OLoRA)."""
        for module_name, layer in self.layers.items():
            if layer.lora_A0 is not None:
                yield module_name, layer.lora_A0, layer.lora_B0

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def add_adapter(model: nn.Module, name: str, config: LoraConfig, *, seed: int,
                dtype: torch.dtype = torch.float32) -> AdapterHandle:
    """Attach a new adapter to the (frozen) model without reloading it."""
    if any(isinstance(m, FusedLoraLinear) and name in m.adapters for m in model.modules()):
        raise ValueError(f"an adapter named '{name}' is already attached")
    candidates = linear_module_names(model)
    # in the model's own order, layer by layer, whatever the order of `target_modules`: a pipeline stage then
    # holds a contiguous run of the adapter's tensors, and its gradient norm sums in the same order
    # (optim.chained_sum) on one device and over stages
    wanted = set(match_targets(candidates, config.target_modules))
    targets = [name for name in candidates if name in wanted]
    # a pipeline stage holds some layers only, the others on `meta` (actors/engine/pipeline/stage_model.py)
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    init_generator = torch.Generator().manual_seed(seed)
    dropout_generator = None
    if config.dropout > 0:
        dropout_generator = torch.Generator(device=device).manual_seed(seed + 1)
    reads_weight = config.use_dora or config.init_lora_weights.startswith(("pissa", "olora"))
    if needs_full_precision_base(config) is not None:
        quantized = [target for target in targets if not _full_precision(model.get_submodule(target))
                     and not _on_meta(model.get_submodule(target))]
        if quantized:
            problem = needs_full_precision_base(config)
            raise ValueError(f"adapter '{name}': {problem} (e.g. {quantized[0]} is "
                             f"{type(model.get_submodule(quantized[0])).__name__})")
    projections = None
    if config.kind == "vera":   # sized over every adapted layer, those of other pipeline stages included
        shapes = [(model.get_submodule(t).in_features, model.get_submodule(t).out_features) for t in targets]
        projections = VeraProjections.generate(config, shapes, device)
    layers: dict[str, LoraAdapter | VeraAdapter] = {}
    for module_name in targets:
        module = model.get_submodule(module_name)
        if projections is not None:
            if _on_meta(module):
                continue
            fused = _wrap(model, module_name)
            vera = VeraAdapter(fused.in_features, fused.out_features, config, projections, device=device, dtype=dtype)
            vera.dropout_generator = dropout_generator
            fused.adapters[name] = vera
            layers[module_name] = vera
            continue
        if _on_meta(module):
            # another pipeline stage's layer: draw what its initialisation draws, so that this stage's
            # layers start where they would on one device, and attach nothing
            LoraAdapter.initial_a(config, module.in_features, init_generator, dtype)
            continue
        fused = _wrap(model, module_name)
        adapter = LoraAdapter(fused.in_features, fused.out_features, config, generator=init_generator,
                              device=device, dtype=dtype, base_weight=base_weight(fused.base) if reads_weight else None,
                              seed=seed)
        adapter.dropout_generator = dropout_generator
        fused.adapters[name] = adapter
        layers[module_name] = adapter
    pool_masters(layers.values(), device)
    return AdapterHandle(name, config, layers, dropout_generator, peft_target_modules(candidates, targets),
                         projections)


def pool_masters(layers: Iterable[nn.Module], device: torch.device) -> torch.Tensor | None:
    """Every plain adapter's A and B of one job made views of one flat tensor, every A first, then every B (their
    values kept): the CUDA path casts a job's whole adapter to the compute dtype, B times the scaling, in two
    operations a step (`lora_cuda.MasterPool`), not two per layer. Each adapter keeps `master_pool` = (the pool,
    where its A starts, where its B starts)."""
    adapters = [layer for layer in layers if isinstance(layer, LoraAdapter) and layer.plain]
    if not adapters:
        return None
    dtype = adapters[0].lora_A.dtype
    a_total = sum(a.lora_A.numel() for a in adapters)
    flat = torch.empty(a_total + sum(a.lora_B.numel() for a in adapters), dtype=dtype, device=device)
    pool = lora_cuda.MasterPool(flat, a_total, adapters[0].scaling)
    positions = {"lora_A": 0, "lora_B": a_total}
    starts: dict[int, dict[str, int]] = {}
    for adapter in adapters:
        for attribute in ("lora_A", "lora_B"):
            parameter = getattr(adapter, attribute)
            position = positions[attribute]
            view = flat[position:position + parameter.numel()].view(parameter.shape)
            view.copy_(parameter.detach())
            setattr(adapter, attribute, nn.Parameter(view))
            starts.setdefault(id(adapter), {})[attribute] = position
            positions[attribute] = position + parameter.numel()
        adapter.master_pool = (pool, starts[id(adapter)]["lora_A"], starts[id(adapter)]["lora_B"])
    return flat


def remove_adapter(model: nn.Module, name: str) -> None:
    """Detach an adapter; layers left with no adapter get their plain linear layer back."""
    for module_name, module in list(model.named_modules()):
        if isinstance(module, FusedLoraLinear) and name in module.adapters:
            del module.adapters[name]
            lora_cuda.forget_masters(module.base)
            if len(module.adapters) == 0:
                _unwrap(model, module_name)


def set_adapters_training(model: nn.Module, training: bool) -> None:
    """Adapter dropout on (training) or off (evaluation); the frozen base always stays in eval mode."""
    for module in model.modules():
        if isinstance(module, FusedLoraLinear):
            module.adapters.train(training)


def freeze(model: nn.Module) -> None:
    for parameter in model.parameters():
        parameter.requires_grad_(False)
