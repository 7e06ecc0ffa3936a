"""Variable-length causal attention over the packed token stream.

Registered with transformers as the attention implementation `aspen_varlen`: each sequence (a packed
sequence or a padded row) attends only to itself, causally. On CUDA in a half dtype it runs one varlen
flash-attention kernel over the whole stream: PyTorch's own `torch.nn.attention.varlen.varlen_attn`
(torch >= 2.10), else flash-attn's `flash_attn_varlen_func` where that package is installed. Elsewhere it
runs scaled-dot-product attention per sequence, so compute is sum(L^2), not T^2 (one kernel launch per
sequence and layer: fine on a CPU, slow on a GPU). Grouped-query attention (fewer key/value heads than query
heads) reaches both kernels with its key/value heads as they are, not repeated (`VARLEN_GQA`). Features the
varlen kernels lack (Gemma 2's attention soft-capping, gpt-oss's attention sinks) run in the per-sequence path
on every device, there in float32 (`exact_sequence_attention`); sliding windows (per layer: each layer passes
its own) run everywhere. Outside a fused step (no layout set) it falls back to plain sdpa, or to the model's
own eager attention for those features. An argument it does not know that would change the result is refused,
not dropped."""

from __future__ import annotations

import importlib.util
import inspect
import sys

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from actors.engine.layout import StepLayout, current_layout, parts

ATTENTION_NAME = "aspen_varlen"
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
try:
    from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn
except ImportError:   # torch < 2.10
    torch_varlen_attn = None


def varlen_gqa_mode(varlen: object, version: str) -> str:
    """How torch's `varlen_attn` (`varlen`; None where torch has none) takes fewer key/value heads than query heads:
    - "flag": `enable_gqa=True` (torch >= 2.12, where varlen_attn refuses unequal head counts without it);
    - "native": torch 2.10 / 2.11, whose varlen_attn has neither the flag nor a check on the head counts and hands
      key and value as they are to `aten._flash_attention_forward` / `_flash_attention_backward`, FlashAttention-2's
      varlen kernels, which take any number of key/value heads dividing the query's (each query head reads its
      group's key/value head; the backward sums each group's dK / dV);
    - "repeat": anything else (no varlen_attn, or a later torch without the flag): the key/value heads repeated.
    Read from torch's torch/nn/attention/varlen.py and aten's flash_attn/flash_api.cpp (mha_varlen_fwd / _bwd);
    tests/gpu/test_cuda.py checks it against per-sequence sdpa on the GPU's torch."""
    if varlen is None:
        return "repeat"
    if "enable_gqa" in inspect.signature(varlen).parameters:
        return "flag"
    if (2, 10) <= TorchVersion(version) < (2, 12):
        return "native"
    return "repeat"


VARLEN_GQA = varlen_gqa_mode(torch_varlen_attn, torch.__version__)


# arguments transformers' attention modules pass that do not change the attention's result (and `output_*`:
# what the model returns besides)
_NEUTRAL_ARGUMENTS = frozenset({"position_ids", "use_cache", "cache_position", "return_dict", "layer_idx",
                                "past_key_values", "cache"})


def _sliding_causal_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    if window is None:
        return distance >= 0
    return (distance >= 0) & (distance < window)


def _refuse_unknown(module: torch.nn.Module, kwargs: dict) -> None:
    unknown = sorted(name for name, value in kwargs.items()
                     if name not in _NEUTRAL_ARGUMENTS and not name.startswith("output_") and value is not None
                     and not (name == "is_causal" and value is True))
    if unknown or getattr(module, "is_causal", True) is False:
        what = ", ".join(unknown) if unknown else "is_causal=False (bidirectional attention)"
        raise NotImplementedError(
            f"{type(module).__name__} passes {what} to its attention, which aspen's varlen attention does not "
            "implement: the result would silently differ from the model's. Add it to actors/engine/attention.py "
            "and the model to actors/engine/model_support.py's verified table, with a test")


def exact_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                             sliding_window: int | None, softcap: float | None,
                             sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of one sequence with soft-capping and sinks, in float32 (what the models' eager
    attention computes): scores = softcap * tanh(q.k * scaling / softcap), masked causally (and to the
    window); each head's sink logit joins the softmax's denominator and is dropped after it.
    query: (1, heads, L, dim); key/value: (1, kv_heads, L, dim). Returns (1, heads, L, dim)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = _sliding_causal_mask(query.shape[2], sliding_window, query.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(1, -1, query.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value.float()).to(value.dtype)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query: (1, heads, T, dim); key/value: (1, kv_heads, T, dim). Returns (1, T, heads, dim).
    `softcap`: Gemma 2's attention soft-cap; `s_aux`: gpt-oss's per-head sink logits."""
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    _refuse_unknown(module, kwargs)
    exact = softcap is not None or sinks is not None   # features the varlen kernels do not have
    layout = current_layout()
    if layout is None or query.shape[0] != 1:
        if exact:   # the model's own eager attention, which has them (sdpa refuses softcap, drops sinks)
            eager = sys.modules[type(module).__module__].eager_attention_forward
            extra = {"softcap": softcap} if softcap is not None else {}
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         sliding_window=sliding_window, **extra, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if dropout != 0.0 and exact:
        raise NotImplementedError(f"{type(module).__name__}: attention dropout with soft-capping or sinks is not "
                                  "implemented (the frozen base runs in eval mode, without dropout)")
    on_gpu = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not exact
    if on_gpu and torch_varlen_attn is not None and dropout == 0.0:
        return torch_varlen_attention(query, key, value, scaling, sliding_window), None
    if on_gpu and HAS_FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func

        cu_seqlens = layout.cu_seqlens(query.device)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        longest = layout.max_sequence_length
        out = flash_attn_varlen_func(*token_major(query, key, value), cu_seqlens, cu_seqlens, longest, longest,
                                     dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=window)
        return out.unsqueeze(0), None
    gqa = query.shape[1] != key.shape[1]
    if layout.tensors.get("fixed-shape"):   # a graphed step's (step_graphs.py): its bounds are on the device only
        if exact:
            raise NotImplementedError(f"{type(module).__name__}: soft-capping or sinks in a graphed step (compile: "
                                      "graphs) off a GPU's varlen kernel; set compile: none")
        return fixed_shape_attention(query, key, value, layout, dropout, scaling, sliding_window, gqa), None
    outputs = []
    # each sequence's queries, keys and values as the views of one split per tensor (linear-cost backward)
    pieces = zip(*(parts(tensor, layout.sequences, dim=2) for tensor in (query, key, value)), strict=True)
    for (start, end), (q, k, v) in zip(layout.sequences, pieces, strict=True):
        if exact:
            out = exact_sequence_attention(q, k, v, scaling, sliding_window, softcap, sinks)
        elif sliding_window and end - start > sliding_window:
            mask = _sliding_causal_mask(end - start, sliding_window, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=gqa)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def fixed_shape_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: StepLayout,
                          dropout: float, scaling: float | None, sliding_window: int | None, gqa: bool) -> torch.Tensor:
    """Attention over a fixed-shape step's whole stream, masked to each sequence (causal, within the window) by the
    sequence slot of each position, read from the bounds' device tensor (actors/engine/fixed_shapes.py): no host
    number of the step's sequences shapes it, so a captured step replays right for new bounds. Dense (T x T): for a
    device without the varlen kernel (the CPU tests of step_graphs.py)."""
    tokens = query.shape[2]
    slot = fixed_sequence_ids(layout.cu_seqlens(query.device), tokens)
    positions = torch.arange(tokens, device=query.device)
    mask = (slot[:, None] == slot[None, :]) & (positions[None, :] <= positions[:, None])
    if sliding_window:
        mask &= positions[:, None] - positions[None, :] < sliding_window
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def fixed_sequence_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each position's sequence slot, from the bounds on the device (no host number; empty slots hold no position)."""
    positions = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True)


def token_major(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(1, heads, T, dim) tensors as the (T, heads, dim) views a varlen kernel takes. `squeeze(0)`, not `[0]`: a
    select's backward writes its gradient into a new zero-filled (1, heads, T, dim) tensor (a fill and a copy each),
    in head-major order, which Liger's RoPE backward then copies back to token-major and a value's view backward
    copies again; a squeeze's backward is a view, so the kernel's token-major gradients reach the projections as
    they are (on the 8B shape: 192 launches and their host time a step fewer)."""
    return tuple(tensor.squeeze(0).transpose(0, 1) for tensor in tensors)


def torch_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                           sliding_window: int | None) -> torch.Tensor:
    """torch's varlen flash-attention over the step's sequences (the current layout), causal, within the window.
    query: (1, heads, T, dim); key/value: (1, kv_heads, T, dim), passed with their own head count where torch's
    kernel takes them so (`VARLEN_GQA`), else repeated. Returns (1, T, heads, dim)."""
    layout = current_layout()
    cu_seqlens = layout.cu_seqlens(query.device)
    longest = layout.max_sequence_length
    window = (sliding_window - 1, 0) if sliding_window else (-1, 0)   # (-1, 0): causal
    groups = query.shape[1] // key.shape[1]
    options = {}
    if groups > 1 and VARLEN_GQA == "flag":
        options["enable_gqa"] = True
    elif groups > 1 and VARLEN_GQA == "repeat":
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch_varlen_attn(*token_major(query, key, value), cu_seqlens, cu_seqlens, longest, longest, scale=scaling,
                            window_size=window, **options)
    return out.unsqueeze(0)


AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Switch a loaded transformers model to the varlen attention (no attention mask is built)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
