"""Optional dependencies (pip extras): import one, or fail with what to install. `pip install aspen-lora`
gives training, the service and the client; quantization (`[quant]`: bitsandbytes) and the embedded MQTT
broker (`[broker]`: amqtt) are extras, `[all]` has both; Liger-Kernel's fused Triton kernels (`[gpu]`) are an
extra outside `[all]` (Triton runs on CUDA GPUs only)."""

from __future__ import annotations

import importlib
from types import ModuleType

DISTRIBUTION = "aspen-lora"


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, needed_for: str, *, in_all: bool = True) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming `needed_for` and the pip command that fixes it
    (`in_all`: the extra is part of `[all]`, which the message then offers too)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(
            f"{needed_for} needs {module.split('.')[0]}, which is not installed ({error}): "
            f"pip install '{DISTRIBUTION}[{extra}]'" + (f" (or '{DISTRIBUTION}[all]')" if in_all else "")) from None
