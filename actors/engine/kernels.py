"""`kernels: liger`: Liger-Kernel's fused Triton kernels for the frozen base's memory-bound work (the `gpu` extra):
RMSNorm (and each residual addition with the RMSNorm that reads its sum, in one kernel), RoPE and SwiGLU swapped into
a loaded model instance, and the LM head's cross-entropy (actors/engine/loss.py) run through Liger's cross-entropy
kernel, which turns each chunk of logits into its losses and gradient in place, in the base's dtype: no chunk of
vocabulary logits is made in float32.

The setting (actors/spec/base_settings.py): `none` leaves the model's operations as transformers built them (its
gated MLPs rebound to the lean SwiGLU, the same values with one tensor less kept: actors/engine/swiglu.py); `liger`
applies the kernels, and refuses where Liger is not installed (naming `pip install 'aspen-lora[gpu]'`) or the base is
not on CUDA (Triton's kernels run on CUDA GPUs; Triton's interpreter, TRITON_INTERPRET=1, runs them on a CPU for
tests); `auto` applies them where Liger is installed and the base is on CUDA in bfloat16 or float16, and runs
without them elsewhere. RMSNorm, RoPE and SwiGLU apply to the architectures of `ARCHITECTURES` (decoders whose
norm, gated MLP and rotary embedding compute what Llama's do); a model of another architecture runs with its own
operations, which is logged once. The loss kernel applies to every architecture: the loss is aspen's, computed
from the LM head (a model's logit scaling folded into the hidden states, its final soft-cap run by the kernel).

Only this model instance changes. Liger's own `apply_liger_kernel_to_<arch>(model=...)` also replaces classes and
functions in the transformers module, so that every model of that architecture built afterwards in the process
(a test's reference, a second base) would run Liger's kernels too; it is not used. Instead, each RMSNorm and
each MLP module's `forward` is rebound on the instance to Liger's functional kernels (the MLP's gate, up and
down projections stay the model's modules, so LoRA wraps them as before), each decoder layer's `forward` to
transformers' own steps with each residual addition and the norm after it (the post-attention norm; the next layer's
input norm) in Liger's fused add-RMSNorm kernel (actors/engine/residual_norms.py: a launch and a pass over the
hidden states fewer each way), each attention module's `forward`
becomes a copy of its class's forward whose global `apply_rotary_pos_emb` is Liger's (the copy's globals, not
the module's), and the LM head's weight is marked for the fused loss (`loss.use_fused_loss`). Where q and k, or gate
and up, are columns of one wider output (the CUDA LoRA path's layers computed together: actors/engine/lora_siblings.py),
RoPE and SwiGLU run where the columns lie (actors/engine/strided_kernels.py: Liger's RoPE kernel, a SwiGLU kernel in
Liger's arithmetic), not on the copies Liger's functions would make.

Isolation. Each of these kernels works token by token: RMSNorm scales each token's hidden vector by its own
mean square, RoPE rotates each token's query and key heads by its own position, SwiGLU is elementwise, and the
cross-entropy kernel reads one target's row of logits per program. No token reads another's values, forward or
backward (the one sum over tokens, RMSNorm's weight gradient, is the frozen norm weight's and is discarded), so
the jobs of a fused step stay as isolated as with the model's own operations, a NaN in one job included.

Numerics. The kernels compute in float32 and round their results to the base's dtype once, where the model's
operations round after each elementwise step: results agree with the model's to that rounding, not bit for bit
(tests/gpu/test_kernels_cuda.py in bfloat16; tests/unit/engine/test_kernels_interpreted.py on a CPU, in float32
under Triton's interpreter, where fused jobs also end bit for bit as alone). The RoPE kernel rotates the query and
key in place, in the projections' outputs, which no backward may keep (a LoRA path that saved a projection's
output for its backward would get it rotated). RMSNorm's backward writes its input gradient over the incoming one
(`in_place=True`, as Liger's own patches for these architectures do; `False` zero-fills a new tensor first, a
launch a norm and step): in these pre-norm decoders a norm's output reaches only matrix products (the projections,
the LM head; Qwen3's q/k norms', the RoPE kernel), whose backward hands it a gradient tensor of its own that no other
node reads afterwards (an addition's backward, which hands one tensor to both operands, never sits above a norm
here: the residual additions read the norms' inputs, not their outputs). The fused add-RMSNorm's backward writes so
too, and hands that one tensor to both of its inputs (the attention's output and the residual), whose consumers read
it: the output projection's backward, and autograd's sum for the layer's input, in place only where it holds the
tensor's last reference."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from types import CellType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from actors.engine import residual_norms, strided_kernels
from actors.engine.extras import require
from actors.engine.loss import use_fused_loss
from actors.engine.recompute import decoder_layers
from actors.engine.swiglu import lean_swiglu
from actors.spec.base_settings import KERNEL_MODES

log = logging.getLogger(__name__)

GPU_EXTRA = "gpu"
OPS = ("rms_norm", "add_rms_norm", "rope", "swiglu", "loss")
HALF_DTYPES = (torch.bfloat16, torch.float16)
_SILU = ("silu", "swish")


@dataclass(frozen=True)
class LigerArchitecture:
    """The classes of one transformers architecture that Liger's kernels replace: its RMSNorm (float32 mean square,
    the normalized vector cast back to the input's dtype, times the weight), its gated MLP
    (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, SiLU), its attention, whose forward calls its module's
    `apply_rotary_pos_emb` (rotate-half RoPE over the whole head), and its decoder layer
    (`residual_norms.decoder_layer_forward`'s steps: a pre-norm attention and MLP, each added to the residual
    stream)."""

    norm: str
    mlp: str
    attention: str
    layer: str


ARCHITECTURES: dict[str, LigerArchitecture] = {
    "llama": LigerArchitecture("LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer"),
    "mistral": LigerArchitecture("MistralRMSNorm", "MistralMLP", "MistralAttention", "MistralDecoderLayer"),
    "qwen2": LigerArchitecture("Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention", "Qwen2DecoderLayer"),
    "qwen3": LigerArchitecture("Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention", "Qwen3DecoderLayer"),   # its q/k norms
}

_told: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _told:
        _told.add(key)
        log.warning(message)


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def triton_interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): its kernels run on CPU tensors, in NumPy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_liger: ModuleType | None = None   # liger_kernel.transformers.functional once imported (the swapped forwards read it)


def _functional() -> ModuleType:
    """Liger's functional kernels, or MissingExtraError naming `pip install 'aspen-lora[gpu]'`."""
    global _liger
    if _liger is None:
        _liger = require("liger_kernel.transformers.functional", GPU_EXTRA, "kernels: liger", in_all=False)
    return _liger


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """"liger" or "none" for the setting `kernels` and a base on `device` in `dtype` (module docstring)."""
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, not '{kernels}'")
    if kernels == "none":
        return "none"
    if kernels == "liger":
        _functional()   # installed, or MissingExtraError naming pip install 'aspen-lora[gpu]'
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(f"kernels: liger needs the base on a CUDA GPU (Liger's kernels are Triton kernels), not "
                             f"on {device.type}; set kernels: none or auto there")
        return "liger"
    if not liger_installed():
        if device.type == "cuda":
            _say_once("auto:missing", "kernels: auto runs the base without fused kernels: Liger-Kernel is not "
                                      "installed (pip install 'aspen-lora[gpu]')")
        return "none"
    if device.type != "cuda" or dtype not in HALF_DTYPES:
        return "none"
    return "liger"


def apply_kernels(model: nn.Module, kernels: str, *, ops: tuple[str, ...] = OPS) -> str:
    """Resolve `kernels` for `model`'s device and dtype and apply the kernels it chooses; returns "liger" or
    "none". `ops`: which of OPS (tests switch them one at a time)."""
    parameter = next(model.parameters())
    choice = resolve_kernels(kernels, parameter.device, parameter.dtype)
    if choice == "liger":
        apply_liger(model, ops)
    if choice != "liger" or "swiglu" not in ops:   # the model's own SwiGLU, keeping less (actors/engine/swiglu.py)
        lean_swiglu(model)
    return choice


def apply_liger(model: nn.Module, ops: tuple[str, ...] = OPS) -> tuple[str, ...]:
    """Swap Liger's kernels into this model instance (module docstring); returns the operations swapped in."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown kernel operations {unknown}: expected some of {', '.join(OPS)}")
    functional = _functional()
    model_type = getattr(model.config, "model_type", None)
    body = [op for op in ops if op != "loss"]
    applied: list[str] = []
    architecture = ARCHITECTURES.get(model_type)
    problem = _architecture_problem(model.config, architecture) if body else None
    if problem is not None:
        _say_once(f"arch:{model_type}", f"kernels: liger: model_type '{model_type}' runs its own RMSNorm, RoPE and "
                                        f"SwiGLU ({problem}); only the loss is fused")
    elif body:
        applied += _swap_modules(model, architecture, body, functional)
    if "loss" in ops:
        head = model.get_output_embeddings()
        use_fused_loss(head.weight, "liger")
        applied.append("loss")
    log.info("kernels: liger on %s (model_type '%s'): %s", type(model).__name__, model_type, ", ".join(applied))
    return tuple(applied)


def _architecture_problem(config: Any, architecture: LigerArchitecture | None) -> str | None:
    if architecture is None:
        return f"Liger's kernels are applied to {', '.join(sorted(ARCHITECTURES))} only"
    act = getattr(config, "hidden_act", None)
    if act not in _SILU:
        return f"its MLP's activation is {act}, not SiLU"
    return None


def _swap_modules(model: nn.Module, architecture: LigerArchitecture, ops: list[str],
                  functional: ModuleType) -> list[str]:
    classes = {"rms_norm": architecture.norm, "swiglu": architecture.mlp, "rope": architecture.attention,
               "add_rms_norm": architecture.layer}
    found: dict[str, list[nn.Module]] = {op: [] for op in ops}
    for module in model.modules():
        for op in ops:
            if type(module).__name__ == classes[op] and (op != "add_rms_norm"
                                                          or residual_norms.pre_norm_layer(module, architecture.norm)):
                found[op].append(module)
    missing = [op for op, modules in found.items() if not modules]
    if missing:   # refused before anything is swapped
        raise ValueError(f"kernels: liger: {type(model).__name__} has no {', '.join(missing)} module of the classes "
                         f"expected for its model_type ({architecture}); set kernels: none")
    residual_norms.LIGER = functional
    for op, modules in found.items():
        for module in modules:
            if op == "rms_norm":
                module.forward = MethodType(_rms_norm_forward, module)
            elif op == "add_rms_norm":
                module.forward = MethodType(residual_norms.decoder_layer_forward, module)
            elif op == "swiglu":
                module.forward = MethodType(_swiglu_forward, module)
            else:
                module.forward = MethodType(_with_liger_rope(type(module).forward, strided_kernels.rope), module)
    if found.get("add_rms_norm"):   # consecutive swapped layers: each computes the next one's input norm
        swapped = {id(layer) for layer in found["add_rms_norm"]}
        layers = list(decoder_layers(model.get_decoder()))
        for layer, after in zip(layers, layers[1:], strict=False):
            if id(layer) in swapped and id(after) in swapped:
                residual_norms.link_layers([layer, after])
    return list(ops)


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm (`casting_mode="llama"`: the mean square in float32, the product with the weight in the
    input's dtype; no offset)."""
    return _liger.liger_rms_norm(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", True)


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(strided_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _with_liger_rope(forward: FunctionType, liger_rope: Any) -> FunctionType:
    """A copy of an attention class's `forward` that calls `liger_rope` where it calls `apply_rotary_pos_emb`
    (one copy per class, shared by its layers)."""
    copy = _rebound(forward, "apply_rotary_pos_emb", liger_rope)
    if copy is None:
        raise ValueError(f"kernels: liger: {forward.__qualname__} does not call apply_rotary_pos_emb, which Liger's "
                         "RoPE replaces; set kernels: none")
    return copy


def _rebound(function: FunctionType, name: str, replacement: Any) -> FunctionType | None:
    """A copy of `function` whose global `name` is `replacement`, or None where it reads no such global.
    Through decorators (`functools.wraps` wrappers, e.g. transformers' `deprecate_kwarg`): the innermost function
    is copied with the new global, and each wrapper with its closure cell that held the wrapped function holding
    the wrapped copy instead; the original functions and their module are untouched."""
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is None:
        if name not in function.__code__.co_names:
            return None
        copy = FunctionType(function.__code__, {**function.__globals__, name: replacement}, function.__name__,
                            function.__defaults__, function.__closure__)
    else:
        inner = _rebound(wrapped, name, replacement)
        if inner is None:
            return None
        cells = function.__closure__ or ()
        holders = [index for index, cell in enumerate(cells) if _holds(cell, wrapped)]
        if len(holders) != 1:
            return None
        closure = tuple(CellType(inner) if index == holders[0] else cell for index, cell in enumerate(cells))
        copy = FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, closure)
        copy.__wrapped__ = inner
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    return copy


def _holds(cell: CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:   # an empty cell
        return False
