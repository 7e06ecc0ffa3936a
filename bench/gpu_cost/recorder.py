"""Every aten operation of a region of code on the virtual CUDA device (`virtual_cuda`), as the GPU would see
it: a TorchDispatchMode that records, per operation, whether it launches kernels (views and allocations do
not), how many, its FLOPs (matrix products and attention), the bytes it reads and writes, the autograd node
running it (backward), and the host synchronisations (a host read of a device tensor, a blocking host-to-device
copy, a device-to-host copy, torch.cuda.synchronize, an operation whose output size depends on the data).

Host tensors keep their values (they are real CPU tensors); a device tensor copied from the host keeps its
value beside it, and small operations whose inputs all have values get theirs (computed on the CPU), so that
index tensors (the grouped LoRA's gathers, cu_seqlens) are known where a rule needs them: the attention's
sequence lengths, the duplicates of an accumulating index_put."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from gpu_cost.operations import (
    ATTENTION,
    ATTENTION_TILE,
    DATA_DEPENDENT,
    FILLS,
    FOREACH_BLOCKS,
    FOREACH_CHUNK,
    FOREACH_TENSORS,
    GATHERS,
    MATMULS,
    NO_KERNEL,
    SCATTERS,
    VALUE_FREE,
    Op,
    dtype_name,
    gemm_shape,
    layout_of,
    mutated,
    tensors,
    touched_bytes,
)
from gpu_cost.virtual_cuda import META, VALUE_LIMIT, Listener, VirtualCuda

# the harness's entry points (the modes' handlers, entered on every torch call and property read)
_HARNESS_FILES = {str(path) for path in Path(__file__).resolve().parent.glob("*.py")} | {
    str(Path(torch.__file__).resolve().parent / name) for name in ("overrides.py", "utils/_python_dispatch.py")}


class PythonCalls:
    """Counts the Python functions the step's code calls (a sys.setprofile hook): the host's Python work
    between operations, where no torch call shows it (the engine's loops over adapters and parameters, the
    modules' forward calls). Not counted while the harness itself runs (`depth` > 0: inside the torch
    function and dispatch modes, where the meta kernels written in Python run)."""

    def __init__(self) -> None:
        self.count = 0
        self.depth = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not self.depth and frame.f_code.co_filename not in _HARNESS_FILES:
            self.count += 1


class KernelRecorder(TorchDispatchMode, Listener):
    """`with VirtualCuda(recorder), recorder: ...`; `recording` on records (`ops`), off only keeps the
    device's behaviour (values, copies, reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.device: VirtualCuda | None = None
        self.recording = False
        self.ops: list[Op] = []
        self.unknown_values: set[str] = set()   # data-dependent operations answered with a placeholder
        self._calls = 0                         # torch calls from Python since the last recorded operation
        self._node: object = None                # the autograd node of the last recorded operation
        self.python = PythonCalls()

    def attach(self, device: VirtualCuda) -> None:
        self.device = device

    def _append(self, op: Op) -> None:
        op.calls, self._calls = self._calls, 0
        op.python, self.python.count = self.python.count, 0
        node = torch._C._current_autograd_node()
        if node is not None and node is not self._node:   # the autograd engine started another node
            op.new_node = True
        self._node = node
        self.ops.append(op)

    # -- the listener's side (virtual_cuda) ---------------------------------------------------------
    def python_call(self) -> None:
        self._calls += 1

    def triton(self, name: str, args: tuple, kwargs: dict, rewritten: tuple = (), traffic: float | None = None
               ) -> None:
        """A Triton kernel: one launch moving its tensor arguments' bytes (each read or written once: the
        memory-bound kernels Liger fuses; those it names as updated in place, `rewritten`, twice), or the bytes it
        says it moves (`traffic`), at vectorised bandwidth; their values unknown from then on. A kernel given an
        int64 tensor (a table of addresses: actors/engine/lora_stacks.py's, lora_grad_kernel.py's) may have written
        any floating tensor: every floating value kept is forgotten. Called inside the harness (`harness`): the
        arguments' flattening (~12,000 Python calls a step of the 8B shape) is not the step's."""
        operands = tensors((args, kwargs))
        for tensor in operands:
            self.device.forget(tensor)
        if any(tensor.dtype == torch.int64 for tensor in operands):
            self.device.forget_floating()
        if self.recording:
            self._append(Op(f"triton:{name}", "kernel", launches=1, dtype=dtype_name(operands), node=_node(),
                            read=traffic if traffic is not None else float(
                                sum(touched_bytes(t) for t in operands) + sum(touched_bytes(t) for t in rewritten)),
                            detail={"layout": "vectorised"},
                            shapes=tuple((tuple(t.shape), t.stride(), str(t.dtype)[6:]) for t in operands)))

    def sync(self, reason: str) -> None:
        if self.recording:
            self._append(Op(reason, "sync", sync=True, node=_node()))

    def take(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops

    # -- dispatch ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.python.depth += 1
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            self.python.depth -= 1

    def harness(self, entering: bool) -> None:
        self.python.depth += 1 if entering else -1

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = func._schema.name.split("::")[-1]
        inputs = tensors((args, kwargs))
        on_device = any(t.is_meta for t in inputs) or kwargs.get("device") == META
        if not on_device:
            out = func(*args, **kwargs)
            if self.recording:
                self._append(Op(name, "view" if name in NO_KERNEL else "host", node=_node()))
            return out
        if name in ("_to_copy", "copy_"):
            copied = self._across(func, name, args, kwargs, inputs)
            if copied is not NotImplemented:
                return copied
        if name == "_local_scalar_dense":
            self.sync("item")
            return self.device.host_copy(args[0]).item()
        if name == "equal":   # no meta kernel: an elementwise comparison and a reduction, then a host read
            return self._equal(args[0], args[1])
        if torch.Tag.nondeterministic_seeded in func.tags:
            kwargs = {key: value for key, value in kwargs.items() if key != "generator"}
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            # no meta kernel: an output whose size depends on the data (nonzero, a boolean mask's index)
            if torch.Tag.dynamic_output_shape not in func.tags and name not in DATA_DEPENDENT:
                raise
            return self._data_dependent(func, name, args, kwargs, inputs)
        self._propagate(func, name, args, kwargs, inputs, out)
        if self.recording:
            self._append(self._describe(func, name, args, kwargs, inputs, out))
        return out

    def _equal(self, first: torch.Tensor, second: torch.Tensor) -> bool:
        """`torch.equal` of two device tensors, as CUDA runs it (an `eq` over both, an `all` over that, the
        answer read on the host): their values compared where both are known; else True (the placeholder for
        a truth value: Liger's loss asks whether its incoming gradient is exactly 1.0, which it is), named in
        `unknown_values`."""
        known = [self.device.value(t) for t in (first, second)]
        if self.recording:
            size = float(first.numel() * first.element_size() + second.numel() * second.element_size())
            self._append(Op("eq", "kernel", launches=1, read=size, written=float(max(first.numel(), 1)),
                            dtype=dtype_name([first]), node=_node()))
            self._append(Op("all", "kernel", launches=1, read=float(max(first.numel(), 1)), written=1.0,
                            dtype="bool", node=_node()))
        self.sync("equal")
        if first.shape != second.shape:
            return False
        if any(value is None for value in known):
            self.unknown_values.add("equal")
            return True
        return bool(torch.equal(known[0], known[1]))

    # -- copies between host and device ---------------------------------------------------------------
    def _across(self, func: Any, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> Any:
        device = self.device
        non_blocking = bool(kwargs.get("non_blocking", False) or (name == "copy_" and len(args) > 2 and args[2]))
        if name == "_to_copy":
            source, target_meta = args[0], kwargs.get("device", args[0].device) == META
            if source.is_meta and not target_meta and kwargs.get("device") is not None:   # device -> host
                value = device.host_copy(source).to(kwargs.get("dtype") or source.dtype)
                self._copy_op("d2h", source, value, sync=not non_blocking)
                return value
            if not source.is_meta and target_meta:                                          # host -> device
                out = func(*args, **kwargs)
                if device.keeps(out):
                    device.remember(out, source.detach().to(out.dtype).clone())
                # where the virtual device's function mode is not entered (a backward's thread), pinning cannot be
                # seen: the engine pins where the device is CUDA (actors/engine/lora_grad_kernel.py's tables)
                pinned = device.is_pinned(source) or not device.pinning_seen()
                self._copy_op("h2d", source, out, sync=not (non_blocking and pinned))
                return out
            return NotImplemented
        target, source = args[0], args[1]
        if target.is_meta and not source.is_meta:                                               # host -> device
            out = func(*args, **kwargs)
            device.remember(target, source.detach().to(target.dtype).clone()
                            if device.keeps(target) and source.shape == target.shape else None)
            self._copy_op("h2d", source, target, sync=not (non_blocking and device.is_pinned(source)))
            return out
        if source.is_meta and not target.is_meta:                                               # device -> host
            target.copy_(device.host_copy(source))
            self._copy_op("d2h", source, target, sync=not non_blocking)
            return target
        return NotImplemented

    def _copy_op(self, kind: str, source: torch.Tensor, target: torch.Tensor, *, sync: bool) -> None:
        if self.recording:
            size = float(source.numel() * source.element_size())
            self._append(Op(f"memcpy_{kind}", kind, launches=1, read=size, written=size, sync=sync,
                               dtype=dtype_name([source]), node=_node(), detail={"pinned_non_blocking": not sync}))

    # -- data-dependent outputs -------------------------------------------------------------------------
    def _data_dependent(self, func: Any, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> Any:
        """nonzero, masked_select, unique...: the host waits for the size. Computed from the inputs' values
        where known; otherwise from placeholders (every element counted as selected), and named in
        `unknown_values`."""
        device = self.device
        known = all(not t.is_meta or device.value(t) is not None for t in inputs)
        if not known:
            self.unknown_values.add(name)

        def host(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                return device.host_copy(value)
            return torch.device("cpu") if value == META else value

        real = func(*tree_map(host, args), **tree_map(host, kwargs))
        out = tree_map(lambda t: t.to(META) if isinstance(t, torch.Tensor) else t, real)
        for meta, value in zip(tensors(out), tensors(real), strict=True):
            device.remember(meta, value)
        if self.recording:
            op = self._describe(func, name, args, kwargs, inputs, out)
            op.sync = True
            op.detail["data_dependent"] = True
            self._append(op)
        return out

    def _propagate(self, func: Any, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                   out: Any) -> None:
        """Values of small device tensors computed from known ones (on the CPU); an in-place operation
        with an unknown input forgets its target's value."""
        device = self.device
        outputs = tensors(out)
        if not outputs:
            return
        meta_inputs = [t for t in inputs if t.is_meta]
        # a factory or fill (ones_like, full, fill_): its first operand gives a shape only, its values do not matter
        shape_only = name in VALUE_FREE and not any(device.value(t) is None for t in meta_inputs[1:])
        if (sum(t.numel() for t in inputs + outputs) > VALUE_LIMIT
                or not shape_only and (not meta_inputs or any(device.value(t) is None for t in meta_inputs)
                                       or torch.Tag.nondeterministic_seeded in func.tags)):
            for tensor in outputs:
                device.forget(tensor)
            return

        def host(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                known = device.value(value)
                return known if known is not None else device.host_copy(value)   # VALUE_FREE's shape operand
            return torch.device("cpu") if value == META else value

        try:
            real = func(*tree_map(host, args), **tree_map(host, kwargs))
        except (RuntimeError, TypeError, ValueError, IndexError):   # not computable on the host: left unknown
            for tensor in outputs:
                device.forget(tensor)
            return
        for meta, value in zip(outputs, tensors(real), strict=False):
            device.remember(meta, value)

    # -- what the GPU does ---------------------------------------------------------------------------------
    def _describe(self, func: Any, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                  out: Any) -> Op:
        outputs = tensors(out)
        node = _node()
        dtype = dtype_name(inputs + outputs)
        if name in NO_KERNEL or func.is_view:
            return Op(name, "view", dtype=dtype, node=node)
        op = Op(name, "kernel", launches=1, dtype=dtype, node=node,
                shapes=tuple((tuple(t.shape), t.stride(), str(t.dtype)[6:]) for t in inputs + outputs))
        inplace = torch.Tag.inplace in func.tags or name.endswith("_")
        written = mutated(func, args, kwargs)
        mutated_ids = {id(t) for t in written}
        fresh = [t for t in outputs if id(t) not in mutated_ids]
        read = [t for t in inputs if not (name == "copy_" and t is args[0])]
        if name in FILLS:
            read = []
        op.read = float(sum(touched_bytes(t) for t in read))
        op.written = float(sum(touched_bytes(t) for t in written + fresh))
        op.detail["layout"] = layout_of(name, inputs, outputs, args)
        if name in MATMULS:
            batch, m, n, k = gemm_shape(name, args, outputs[0])
            op.gemm = (batch, m, n, k)
            op.flops = 2.0 * batch * m * n * k
            op.dtype = dtype_name([args[1] if name.rstrip("_") in ("addmm", "baddbmm", "addbmm") else args[0]])
        elif name in ATTENTION:
            self._attention(op, name, args, kwargs, func)
        elif name in GATHERS:
            index_bytes = sum(touched_bytes(t) for t in inputs if not t.is_floating_point())
            op.read = float(op.written + index_bytes)
        elif name in SCATTERS:
            self._scatter(op, name, args, kwargs, inputs, outputs)
        elif name.startswith("_foreach_") or name.startswith("_fused_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            count = max((len(a) for a in lists), default=1)
            elements = sum(t.numel() for t in lists[0]) if lists else 0
            limit = FOREACH_TENSORS.get(min(len(lists), 5), 30)
            op.launches = max(math.ceil(count / limit), math.ceil(elements / FOREACH_CHUNK / FOREACH_BLOCKS), 1)
            op.detail["tensors"] = count
        if all(t.numel() == 0 for t in outputs) and not inplace and name not in SCATTERS:
            op.launches = 0
        return op

    def _attention(self, op: Op, name: str, args: tuple, kwargs: dict, func: Any) -> None:
        """FLOPs of attention: per sequence 4 L^2 d heads forward (QK^T and PV), half of it causal; 2.5 times
        the forward backward (five products, the scores recomputed)."""
        query = args[0]
        causal = True
        if query.dim() == 3:                        # varlen: (tokens, heads, d), sequences from cu_seqlens
            tokens, heads, dim = query.shape
            lengths = self._sequence_lengths(args, tokens)
        else:                                       # (batch, heads, L, d) of sdpa; (batch, L, heads, d) of flash
            batch, a, b, dim = query.shape
            heads, length = (a, b) if name.startswith("_scaled") else (b, a)
            lengths = [length] * batch
            names = [argument.name for argument in func._schema.arguments]
            if "is_causal" in names:
                position = names.index("is_causal")
                causal = bool(args[position] if position < len(args) else kwargs.get("is_causal", False))
        forward = sum(4.0 * length * length * dim * heads for length in lengths) * (0.5 if causal else 1.0)
        op.flops = forward * (2.5 if "backward" in name else 1.0)
        # what the kernel computes: whole 128 x 128 tiles of scores (a short sequence fills few of its tile)
        blocks = [math.ceil(length / ATTENTION_TILE) for length in lengths]
        pairs = sum(b * (b + 1) / 2 if causal else b * b for b in blocks)
        op.detail["tile_flops"] = pairs * 4.0 * ATTENTION_TILE ** 2 * dim * heads * (2.5 if "backward" in name else 1.0)
        op.detail["sequences"] = len(lengths)
        op.detail["longest"] = max(lengths) if lengths else 0

    def _sequence_lengths(self, args: tuple, tokens: int) -> list[int]:
        """The sequences' lengths from cu_seqlens (the first int32 tensor argument) where its value is
        known, else one sequence of every token."""
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dtype == torch.int32 and arg.dim() == 1:
                value = self.device.value(arg)
                if value is not None:
                    bounds = value.tolist()
                    return [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
                self.unknown_values.add("cu_seqlens")
                break
        return [tokens]

    def _scatter(self, op: Op, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                 outputs: list[torch.Tensor]) -> None:
        """Bytes of the rows touched; for an accumulating index_put (autograd's backward of a gather), the
        index's duplicates: CUDA sorts the indices and adds each index's duplicates one after another."""
        values = [t for t in inputs if t.is_floating_point()]
        touched = float(touched_bytes(values[-1])) if values else 0.0
        indices = [t for t in tensors(args[1:]) if not t.is_floating_point()]
        op.read = touched * (2 if name != "embedding_dense_backward" else 1) + sum(touched_bytes(t) for t in indices)
        op.written = touched
        accumulate = (name in ("_index_put_impl_", "index_put_", "index_put", "_unsafe_index_put")
                      and bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False)))
        if accumulate or name == "embedding_dense_backward":
            index_list = [t for t in indices if t.dtype in (torch.int64, torch.int32)]
            op.detail["accumulate"] = True
            op.detail["indices"] = int(index_list[0].numel()) if index_list else 0
            duplicates = self._duplicates(args[0], index_list) if name != "embedding_dense_backward" else None
            if duplicates is None:
                self.unknown_values.add(f"{name} indices")
            op.detail["max_duplicates"] = duplicates or 1
            op.detail["row_elements"] = values[-1].numel() // max(op.detail["indices"], 1) if values else 0

    def _duplicates(self, target: torch.Tensor, index_list: list[torch.Tensor]) -> int | None:
        """The most times one position of `target` is written by an index_put with these index tensors
        (indexing its leading dimensions), from their values; None where one is unknown."""
        values = [self.device.value(index) for index in index_list]
        if not values or any(value is None for value in values):
            return None
        values = torch.broadcast_tensors(*values)
        linear = torch.zeros_like(values[0])
        for dim, value in enumerate(values):
            linear = linear * target.shape[dim] + value % max(target.shape[dim], 1)
        if not linear.numel():
            return 1
        return int(torch.unique(linear, return_counts=True)[1].max())


def _node() -> str | None:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else None

