"""Host-to-device copies that never make the host wait.

A copy from ordinary (pageable) host memory to a CUDA device waits for every kernel already queued on the stream
before it starts, so each one inside a step stalls the host until the GPU has caught up, and the GPU then idles
while the host launches the next kernels. A copy from pinned (page-locked) memory with `non_blocking=True` is
queued like a kernel instead: the host goes on at once. PyTorch's caching host allocator keeps the pinned block
until the copy that reads it has run, so the host tensor may be dropped right after. On other devices these are
plain copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without waiting on CUDA."""
    if device.type != "cuda":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def values_to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-d tensor of `values` on `device`, without waiting on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def concatenated_to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-d host tensors of one dtype moved in one copy: the device tensors, views of one buffer, in order."""
    if not tensors:
        return []
    host = torch.cat([t.reshape(-1) for t in tensors])
    buffer = to_device(host, device)
    out, start = [], 0
    for tensor in tensors:
        out.append(buffer[start:start + tensor.numel()].view(tensor.shape))
        start += tensor.numel()
    return out
