"""What a user's custom loss (actors/engine/custom_loss.py) may call, by the names torch.fx records: pure
arithmetic on tensors, reductions and shapes, nothing that reads or writes anything but its own operands.

A name outside these lists is refused when the loss is created. Left out on purpose:
- in-place methods (`add_`, ...): they would write into the model's log-probabilities;
- operations whose output size depends on values (`nonzero`, `masked_select`, `unique`, one-argument
  `where`): a loss's shapes are then the same in its check before the step and in the step;
- integer indexing (`gather`, `index_select`, `scatter`, `take`): an index out of range is a device-side
  assertion on CUDA, which ends the trainer's process (boolean masks and slices are allowed);
- size-making operations beyond the operands' own (`repeat`, `expand`, `outer`, `matmul`, `kron`, `full`,
  `zeros`): each tensor a loss makes stays within a bound of its datum's own (`custom_loss.size_cap`);
  `arange` is allowed, its length checked before it runs;
- anything that leaves torch (`item`, `tolist`, `numpy`), moves tensors (`cpu`, `cuda`), or touches storage,
  hooks, files or the autograd graph (`backward`, `register_hook`, `retain_grad`)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F

ELEMENTWISE = frozenset("""
abs absolute neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square pow float_power reciprocal sign sgn
sigmoid tanh sinh cosh sin cos tan asin acos atan atan2 relu floor ceil round trunc frac erf erfc erfinv lgamma
digamma xlogy logit clamp clip clamp_min clamp_max minimum maximum fmin fmax add sub subtract mul multiply div
divide true_divide floor_divide remainder fmod lerp hypot logaddexp logaddexp2 isnan isinf isfinite isposinf
isneginf nan_to_num logical_and logical_or logical_not logical_xor eq ne lt le gt ge greater greater_equal less
less_equal not_equal equal where signbit copysign heaviside
""".split())
REDUCTIONS = frozenset("""
sum mean nansum nanmean prod amax amin max min logsumexp std var norm median nanmedian all any count_nonzero
argmax argmin cumsum cumprod cummax cummin logcumsumexp softmax log_softmax dot sort topk
""".split())
SHAPES = frozenset("""
reshape flatten squeeze unsqueeze transpose permute movedim narrow chunk split unbind flip roll stack cat
concat concatenate hstack vstack t atleast_1d atleast_2d select
""".split())
MADE = frozenset("zeros_like ones_like full_like tensor scalar_tensor arange".split())   # no random draws: the
# trainer's generators are its jobs'
TORCH_FUNCTIONS = ELEMENTWISE | REDUCTIONS | SHAPES | MADE
NN_FUNCTIONS = frozenset("""
log_softmax softmax logsigmoid log_sigmoid softplus relu elu gelu silu leaky_relu hardtanh normalize
binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss huber_loss kl_div softsign tanhshrink
""".split())
SPECIAL = frozenset("expit logit log1p xlogy xlog1py entr logsumexp log_softmax softmax erf erfc ndtr log_ndtr".split())
OPERATORS = frozenset("""
add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor invert not_ getitem
""".split())
MATH = frozenset("""
exp log log1p log2 log10 sqrt pow fabs floor ceil trunc isnan isinf isfinite tanh sin cos atan atan2 hypot erf
erfc lgamma gamma expm1 copysign fmod
""".split()) | frozenset(["inf", "nan", "pi", "e"])
# Tensor methods: the functions above as methods, conversions, views within the operand's size
METHODS = (TORCH_FUNCTIONS - MADE) | frozenset("""
detach float double half bfloat16 long int bool to type_as size dim numel contiguous clone view view_as
reshape_as expand_as masked_fill
""".split()) - frozenset(["tensor", "concat", "concatenate", "hstack", "vstack", "atleast_1d", "atleast_2d"])
ATTRIBUTES = frozenset("shape ndim dtype T mT values indices".split())
DTYPES = frozenset("float32 float64 float16 bfloat16 float double half int64 int32 int16 int8 uint8 long int bool"
                   .split())


def function(target: str) -> Callable | None:
    """The callable a recorded call_function target names, where it is allowed; else None."""
    module, _, name = target.rpartition(".")
    if target == "getattr":
        return getattr
    if module == "torch" and name in TORCH_FUNCTIONS:
        return getattr(torch, name, None)
    if module in ("torch.nn.functional", "torch._C._nn") and name in NN_FUNCTIONS:
        return getattr(F, name, None) or getattr(torch._C._nn, name, None)
    if module in ("torch.special", "torch._C._special"):
        short = name.removeprefix("special_")
        return getattr(torch.special, short, None) if short in SPECIAL else None
    if module in ("operator", "_operator") and name in OPERATORS:
        return getattr(operator, name)
    if module == "math" and name in MATH and callable(getattr(math, name, None)):
        return getattr(math, name)
    return None


def dtype(name: str) -> torch.dtype | None:
    """The dtype an encoded `{"dtype": name}` names, where allowed."""
    name = name.removeprefix("torch.")
    value = getattr(torch, name, None) if name in DTYPES else None
    return value if isinstance(value, torch.dtype) else None
