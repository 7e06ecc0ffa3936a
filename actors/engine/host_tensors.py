"""Tensors brought to the host for a write: a contiguous CPU tensor, a copy of its own only where asked."""

from __future__ import annotations

import torch


def on_host(tensor: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = True) -> torch.Tensor:
    """`tensor` as a contiguous CPU tensor (of `dtype`). `copy`: a snapshot of its own; else the tensor itself
    where it already is one (no memory spent: for a write that ends before the tensor next changes)."""
    host = tensor.detach().to("cpu", dtype).contiguous()
    shared = host.device == tensor.device and host.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    return host.clone() if copy and shared else host
