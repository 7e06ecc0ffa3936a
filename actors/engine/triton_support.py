"""The engine's own Triton kernels' common ground (actors/engine/flat_adamw.py, lora_grad_kernel.py): Triton where it is
installed, whether it runs on a device, and each kernel's once-per-device check against its torch reference, after
which a kernel that failed or disagreed is logged once and its reference does the work."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

try:   # Triton comes with torch's CUDA builds (and the `gpu` extra); without it the references run
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - a CPU-only install without the extra
    triton = tl = None
try:   # the base of Triton's compile and launch errors (triton.errors since 3.0)
    from triton.errors import TritonError
except ImportError:   # pragma: no cover - no Triton, or an older one
    TritonError = RuntimeError

log = logging.getLogger(__name__)

# what a kernel that cannot compile or launch on a device raises (its check then leaves the work to torch)
KERNEL_ERRORS = (TritonError, RuntimeError, NotImplementedError, ValueError, TypeError)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code: Triton's is a `constexpr_function` whose wrapper costs the host ~5 Python calls a
    call (a launch grid a layer counts on a host-bound step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (the least power of 2 at least `n`, for n >= 1), without its wrapper."""
    return 1 << (n - 1).bit_length()


def triton_runs(device: torch.device) -> bool:
    """Whether Triton's kernels run on this device: on CUDA, or on a CPU under Triton's interpreter (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


class KernelCheck:
    """One kernel's check, once per device: `agrees(device)` runs it beside its reference on a small case. A kernel
    that raises or disagrees is logged once (`what` failed; `instead` does the work) and not used on that device."""

    def __init__(self, what: str, instead: str, agrees: Callable[[torch.device], bool]):
        self.what, self.instead, self.agrees = what, instead, agrees
        self.checked: dict[str, bool] = {}

    def works(self, device: torch.device) -> bool:
        key = str(device)
        if key not in self.checked:
            try:
                agreed = self.agrees(device)
                if not agreed:
                    log.warning("%s disagrees with its reference on %s; %s instead", self.what, device, self.instead)
            except KERNEL_ERRORS as error:   # a Triton that cannot compile or launch here
                log.warning("%s failed its check on %s (%s: %s); %s instead", self.what, device,
                            type(error).__name__, error, self.instead)
                agreed = False
            self.checked[key] = agreed
        return self.checked[key]
