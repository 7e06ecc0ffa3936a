"""Variable-length causal attention over the packed token stream.

Registered with transformers as the attention implementation `aspen_varlen`: each sequence (a packed
sequence or a padded row) attends only to itself, causally. On CUDA in a half dtype it runs one varlen
flash-attention kernel over the whole stream: PyTorch's own `torch.nn.attention.varlen.varlen_attn`
(torch >= 2.10), else flash-attn's `flash_attn_varlen_func` where that package is installed. Elsewhere it
runs scaled-dot-product attention per sequence, so compute is sum(L^2), not T^2 (one kernel launch per
sequence and layer: fine on a CPU, slow on a GPU). Outside a fused step (no layout set) it falls back to
plain sdpa."""

from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from actors.engine.layout import current_layout

ATTENTION_NAME = "aspen_varlen"
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
try:
    from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn
except ImportError:   # torch < 2.10
    torch_varlen_attn = None
# torch's varlen kernel takes grouped key/value heads itself from 2.12 on (`enable_gqa`); before, we repeat them
VARLEN_TAKES_GQA = torch_varlen_attn is not None and "enable_gqa" in inspect.signature(torch_varlen_attn).parameters


def _sliding_causal_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query: (1, heads, T, dim); key/value: (1, kv_heads, T, dim). Returns (1, T, heads, dim)."""
    layout = current_layout()
    if layout is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    on_gpu = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if on_gpu and torch_varlen_attn is not None and dropout == 0.0:
        cu_seqlens = layout.cu_seqlens(query.device)
        longest = layout.max_sequence_length
        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)   # (-1, 0): causal
        groups = query.shape[1] // key.shape[1]
        options = {}
        if groups > 1 and VARLEN_TAKES_GQA:
            options["enable_gqa"] = True
        elif groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = torch_varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                cu_seqlens, cu_seqlens, longest, longest, scale=scaling, window_size=window,
                                **options)
        return out.unsqueeze(0), None
    if on_gpu and HAS_FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func

        cu_seqlens = layout.cu_seqlens(query.device)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                     cu_seqlens, cu_seqlens, layout.max_sequence_length,
                                     layout.max_sequence_length, dropout_p=dropout, softmax_scale=scaling,
                                     causal=True, window_size=window)
        return out.unsqueeze(0), None
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for start, end in layout.sequences:
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if sliding_window and end - start > sliding_window:
            mask = _sliding_causal_mask(end - start, sliding_window, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=gqa)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Switch a loaded transformers model to the varlen attention (no attention mask is built)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
