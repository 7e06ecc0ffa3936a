"""Liger-Kernel's Triton kernels on CPU tensors, for the tests: Triton's interpreter runs each kernel's programs one
after another in NumPy. It must be on (TRITON_INTERPRET=1) before triton is first imported, since triton's own
library functions (tl.sum, tl.sigmoid, ...) are made interpreted or compiled then, and transformers imports triton
as it loads a model: so the tests that run Liger's kernels (tests/unit/engine/test_kernels_interpreted.py) run in
a process of their own started with it (tests/unit/engine/test_kernels.py starts it), not in the test suite's.

Two gaps of Triton 3.x's interpreter are filled here, in that process only:
- a float kernel argument (an epsilon, a soft-cap) reaches the kernel as a Python float, on which Liger's kernels
  call `.to(tl.float32)`; a compiled kernel receives it as an fp32 scalar, so it is wrapped here as the
  interpreter wraps an int (an fp32 scalar tensor);
- libdevice's functions, which the interpreter does not emulate (a call returns None), are bound in the Liger
  modules that import them to the interpreter's own: `rsqrt` (RMSNorm, the fused add-RMSNorm) to `tl.rsqrt`, `tanh` (the
  cross-entropy's soft-cap) to 2·sigmoid(2x) - 1, the same function.
A third gap, filled by `bfloat16_rounded_as_compiled` where a test asks for it: the interpreter truncates a float32
value cast to bfloat16, where compiled Triton rounds it to nearest even (CUDA's cvt.rn, torch's rounding).
The interpreter does not emulate bfloat16 arithmetic (NumPy has none: a bfloat16 product comes out as garbage),
so the tests under it run in float32; bfloat16 runs on a GPU (tests/gpu/test_kernels_cuda.py)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

LIGER_MODULES = ("liger_kernel.ops.rms_norm", "liger_kernel.ops.fused_add_rms_norm", "liger_kernel.ops.cross_entropy",
                 "liger_kernel.ops.rope", "liger_kernel.ops.swiglu")


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Triton is installed and its library functions were made interpreted (TRITON_INTERPRET=1 before its import):
    the engine's own kernels run on CPU tensors."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def interpreter_on() -> bool:
    """Triton's library functions were made interpreted: TRITON_INTERPRET=1 was set before triton's import."""
    if not liger_installed():
        return False
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


@functools.cache
def liger_interpreted() -> bool:
    """Liger's kernels can run here on CPU tensors (installed, the interpreter on from the start); the
    interpreter's gaps filled once."""
    if not interpreter_on():
        return False
    _patch_interpreter()
    return True


def _patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def with_floats(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = with_floats
    modules = {name: importlib.import_module(name) for name in LIGER_MODULES}
    modules["liger_kernel.ops.rms_norm"].rsqrt = lambda x: tl.rsqrt(x)
    modules["liger_kernel.ops.fused_add_rms_norm"].rsqrt = lambda x: tl.rsqrt(x)
    modules["liger_kernel.ops.cross_entropy"].tanh = lambda x: 2 * tl.sigmoid(2 * x) - 1


@functools.cache
def bfloat16_rounded_as_compiled() -> None:
    """The interpreter's float32 -> bfloat16 conversions round to nearest even, as compiled Triton's (and torch's)
    do, instead of truncating (a kernel that writes a bfloat16 copy is then compared with torch's bit for bit)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            source = torch.from_numpy(np.frombuffer(values.tobytes(), dtype=np.float32).copy())
            return source.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(values.shape)
        return convert(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = rounded


REPO = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, timeout: int) -> None:
    """pytest on `module` (a path from the repository's root) in a process started with TRITON_INTERPRET=1: asserts
    that it passed, and that none of it was skipped or failed."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-W", "ignore::DeprecationWarning", module], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
