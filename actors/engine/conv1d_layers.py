"""GPT-2's `Conv1D` projections as plain linear layers: transformers' `Conv1D` (GPT-2 and DistilGPT-2's `c_attn`,
`c_proj`, `c_fc`) is a linear layer that stores its weight transposed, (in, out), and computes `x W + b`. The
frozen base is re-laid out once as it loads: each becomes an `nn.Linear` holding the same weight as (out, in), the
same product, so that every path that adapts, fuses, quantizes or measures linear layers takes it as it is.

What is saved keeps PEFT's view of the layer: LoRA's A (r, in) and B (out, r) are the same for a Conv1D and a
linear layer, and an adapter of converted layers is saved with `fan_in_fan_out: true` (PEFT's flag for Conv1D
bases), so that PEFT merges it into the checkpoint's transposed weight the right way round (`adapter_export`; the
file-by-file merge declines such adapters and leaves them to PEFT)."""

from __future__ import annotations

from torch import nn

CONVERTED = "_aspen_from_conv1d"   # set on a linear layer converted from a Conv1D


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:   # a transformers without it has no such layers to convert
        return None
    return Conv1D


def conv1d_as_linear(model: nn.Module) -> int:
    """Replace every `Conv1D` of `model` by an `nn.Linear` of the same product (weight transposed once, on its
    device, in its dtype); returns how many were replaced. bitsandbytes' layers that transformers' on-the-fly
    quantization made of Conv1D layers (their weight transposed as it loaded; `source_cls` names the class) are
    marked as converted too."""
    conv1d = _conv1d_class()
    if conv1d is None:
        return 0
    for module in model.modules():
        source = getattr(module, "source_cls", None)
        if isinstance(module, nn.Linear) and isinstance(source, type) and issubclass(source, conv1d):
            setattr(module, CONVERTED, True)
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, conv1d)]
    for name, module in found:
        in_features, out_features = module.weight.shape
        weight = module.weight.detach()
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.t().contiguous(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach(), requires_grad=module.bias.requires_grad)
        setattr(linear, CONVERTED, True)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    return len(found)


def from_conv1d(module: nn.Module) -> bool:
    """Whether this linear layer was a `Conv1D` in the checkpoint (its weight stored there as (in, out))."""
    return bool(getattr(module, CONVERTED, False))


def transposed_in_checkpoint(layers: list[nn.Module]) -> bool:
    """Whether any of these (wrapped or plain) linear layers stores its weight transposed in the checkpoint: an
    adapter over them is PEFT's `fan_in_fan_out` one."""
    return any(from_conv1d(getattr(layer, "base", layer)) for layer in layers)

