"""Users' custom losses run on the trainer (the Tinker API's `create_custom_loss`): a loss traced by torch.fx on
the user's machine arrives as data, node by node, and is rebuilt here from aspen's own lists of allowed
operations (actors/engine/custom_loss_ops.py); nothing in it is executed as code.

A loss runs once per datum on the datum's target log-probabilities (differentiable; (N,) or (N, K)) and the
`loss_fn_inputs` it names, and returns a scalar loss and scalar metrics (`custom/<name>:sum` or `:mean`); a call's
loss is the sum of its datums' (as the SDK runs the same loss on the client). So it trains in the one fused
forward-backward of the step, not in a forward, a round trip and a second pass as `forward_backward_custom` takes.

Each datum's loss is first run on the host before the step (`check`), on its own inputs and a stand-in for the
log-probabilities: a loss that fails, returns no scalar or makes a tensor past its bound fails that call alone,
naming the node. What could then differ inside the step is kept out: shapes never depend on the model's values
(no value-sized operations; a boolean mask computed from the log-probabilities cannot index), so a loss that passed
its check runs in the step. Every tensor it makes stays within `size_cap` elements, checked before a broadcast
or an `arange` is made and after every operation."""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actors.engine import custom_loss_ops as ops

MAX_NODES = 512
MAX_INPUTS = 16
MAX_LIST = 16            # the operands of one call that a list holds (torch.cat's)
MIN_CAP = 1 << 20        # elements a loss's tensor may always have
CAP_FACTOR = 4           # ... or this many times its datum's largest operand
METRIC_SUFFIXES = (":sum", ":mean")
# a call's datums times its loss's operations: each runs once on the host before the step and once in it, a few
# microseconds each on small tensors, so a call's loss costs the trainer at most about a second or two of each
MAX_CALL_OPERATIONS = 1 << 17


class CustomLossError(ValueError):
    """A custom loss that cannot be created or run; the message names the node and what to change."""


@dataclass(frozen=True)
class CustomLoss:
    """A user's loss as data: its name, its inputs (`logprobs` first, then the loss_fn_inputs it reads) with their
    ranks, and its graph's nodes as JSON text (hashable, and what travels to a trainer)."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    graph: str

    @staticmethod
    def of(name: str, inputs: Sequence[tuple[str, int]], nodes: Sequence[Mapping[str, Any]]) -> CustomLoss:
        """Checked: every node rebuilt from the allowed operations (CustomLossError naming the first that is not)."""
        loss = CustomLoss(str(name), tuple((str(n), int(r)) for n, r in inputs), json.dumps(list(nodes)))
        loss.program()
        return loss

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs it reads, in the order it takes them."""
        return tuple(name for name, _ in self.inputs[1:])

    def program(self) -> Program:
        return _program(self)

    def check_call_size(self, datums: int) -> None:
        """CustomLossError where a call of this many datums would run more than MAX_CALL_OPERATIONS operations."""
        each = len(self.program().steps)
        if each * datums > MAX_CALL_OPERATIONS:
            raise CustomLossError(f"custom loss '{self.name}' runs {each} operations a datum, {each * datums} for "
                                  f"this call's {datums} datums; a call may run at most {MAX_CALL_OPERATIONS}: send "
                                  f"at most {MAX_CALL_OPERATIONS // each} datums a call")

    def check_datum(self, inputs: Mapping[str, torch.Tensor], logprobs_shape: tuple[int, ...], datum: int) -> None:
        """Run it on this datum's inputs (on the host) and a stand-in for its log-probabilities: CustomLossError
        saying which datum, node and why where it would fail in the step."""
        for name, rank in self.inputs[1:]:
            if name not in inputs:
                raise CustomLossError(f"datum {datum}: loss_fn_inputs lacks '{name}', which custom loss "
                                      f"'{self.name}' reads")
            if inputs[name].dim() != rank:
                raise CustomLossError(f"datum {datum}: loss_fn_inputs '{name}' has rank {inputs[name].dim()}, but "
                                      f"custom loss '{self.name}' declared it with rank {rank}")
        if len(logprobs_shape) != self.inputs[0][1]:
            raise CustomLossError(f"datum {datum}: target_tokens has rank {len(logprobs_shape)}, but custom loss "
                                  f"'{self.name}' declared logprobs with rank {self.inputs[0][1]}")
        stand_in = torch.zeros(logprobs_shape, requires_grad=True)
        try:
            self.program().run(stand_in, [inputs[name].float() for name in self.input_names])
        except CustomLossError as error:
            raise CustomLossError(f"datum {datum}: {error}") from None


@functools.lru_cache(maxsize=256)
def _program(loss: CustomLoss) -> Program:
    return Program(loss)


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Step:
    name: str
    target: str
    call: Any              # a callable, or a method's name ("method") or an attribute's ("getattr")
    kind: str              # "function", "method" or "getattr"
    args: tuple
    kwargs: dict


class _Device:
    """Stands for any device a loss names: its tensors are made where its datum's are."""


DEVICE = _Device()


class Program:
    """A custom loss rebuilt: its steps, each an allowed operation on earlier steps' values or constants."""

    def __init__(self, loss: CustomLoss):
        self.name = loss.name
        self.steps: list[_Step] = []
        try:
            nodes = json.loads(loss.graph)
        except ValueError as error:
            raise CustomLossError(f"custom loss '{loss.name}': its graph is not JSON ({error})") from None
        if not isinstance(nodes, list) or not 1 <= len(nodes) <= MAX_NODES:
            raise CustomLossError(f"custom loss '{loss.name}': a graph has 1 to {MAX_NODES} nodes")
        if not 1 <= len(loss.inputs) <= MAX_INPUTS or loss.inputs[0] not in (("logprobs", 1), ("logprobs", 2)):
            raise CustomLossError(f"custom loss '{loss.name}': its inputs are logprobs (rank 1 or 2) then at most "
                                  f"{MAX_INPUTS - 1} loss_fn_inputs")
        known: set[str] = set()
        self.placeholders: list[str] = []
        self.output: tuple[_Ref, dict[str, _Ref]] | None = None
        for node in nodes:
            self._add(loss, node, known)
        if self.placeholders != [name for name, _ in loss.inputs]:
            raise CustomLossError(f"custom loss '{loss.name}': its placeholders {self.placeholders} are not its "
                                  f"inputs {[name for name, _ in loss.inputs]}")
        if self.output is None:
            raise CustomLossError(f"custom loss '{loss.name}': its graph has no output node")

    def _add(self, loss: CustomLoss, node: Any, known: set[str]) -> None:
        if not isinstance(node, dict) or not isinstance(node.get("name"), str):
            raise CustomLossError(f"custom loss '{loss.name}': a node is not an object with a name")
        name, op, target = node["name"], node.get("op"), str(node.get("target", ""))
        where = f"custom loss '{loss.name}', node '{name}' ({op} {target})"
        if name in known or self.output is not None:
            raise CustomLossError(f"{where}: a node after the output, or a name used twice")
        args = _decode(node.get("args", []), known, where)
        kwargs = _decode({"dict": node.get("kwargs", {})}, known, where)
        if op == "placeholder":
            self.placeholders.append(target)
        elif op == "output":
            self.output = _output(args, where)
        elif op == "call_function":
            fn = ops.function(target)
            if fn is None:
                raise CustomLossError(f"{where}: {target} is not an operation a custom loss may call here "
                                      "(pure torch, math and operator arithmetic: actors/engine/custom_loss_ops.py)")
            if fn is getattr and not (len(args) == 2 and args[1] in ops.ATTRIBUTES):
                raise CustomLossError(f"{where}: reads an attribute other than {sorted(ops.ATTRIBUTES)}")
            kind = "getattr" if fn is getattr else "function"
            self.steps.append(_Step(name, target, args[1] if fn is getattr else fn, kind,
                                    args[:1] if fn is getattr else args, kwargs))
        elif op == "call_method":
            if target not in ops.METHODS:
                raise CustomLossError(f"{where}: Tensor.{target} is not a method a custom loss may call here "
                                      "(no in-place methods, none that leave torch or size by values)")
            self.steps.append(_Step(name, target, target, "method", args, kwargs))
        else:
            raise CustomLossError(f"{where}: a custom loss's nodes are placeholders, calls of functions and "
                                  "methods, and its output (no modules, no captured tensors)")
        known.add(name)

    def run(self, logprobs: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the datum's loss, a 0-dimensional tensor; its metrics by name)."""
        values: dict[str, Any] = dict(zip(self.placeholders, [logprobs, *inputs], strict=True))
        cap = max(MIN_CAP, CAP_FACTOR * max(value.numel() for value in values.values()))
        tainted = {self.placeholders[0]}   # tensors whose values depend on the log-probabilities
        for step in self.steps:
            try:
                args, kwargs = _placed(step, _resolve(step.args, values, logprobs.device),
                                       _resolve(step.kwargs, values, logprobs.device), logprobs.device)
                _check_before(step, args, kwargs, tainted, cap)
                if step.kind == "getattr":
                    value = getattr(args[0], step.call)
                elif step.kind == "method":
                    value = getattr(args[0], step.call)(*args[1:], **kwargs)
                else:
                    value = step.call(*args, **kwargs)
                _check_after(value, cap)
            except CustomLossError as error:
                raise CustomLossError(f"custom loss '{self.name}', node '{step.name}' ({step.target}): {error}") \
                    from None
            except Exception as error:   # noqa: BLE001 - any failure of the user's graph is its call's, said so
                raise CustomLossError(f"custom loss '{self.name}', node '{step.name}' ({step.target}): "
                                      f"{type(error).__name__}: {error}") from None
            values[step.name] = value
            if step.kind != "getattr" or step.call in ("values", "indices", "T", "mT"):
                if _tensors_of(step.args, tainted) or _tensors_of(step.kwargs, tainted):
                    tainted.add(step.name)
        return self._outputs(values)

    def _outputs(self, values: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert self.output is not None
        loss_ref, metric_refs = self.output
        loss = values[loss_ref.name]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CustomLossError(f"custom loss '{self.name}' must return a scalar floating-point loss, got {shape}")
        metrics = {}
        for key, ref in metric_refs.items():
            value = values[ref.name]
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise CustomLossError(f"custom loss '{self.name}': metric '{key}' must be a one-element tensor")
            metrics[key] = value.detach().reshape(())
        return loss, metrics


def _output(args: tuple, where: str) -> tuple[_Ref, dict[str, _Ref]]:
    if len(args) != 1 or not isinstance(args[0], tuple) or len(args[0]) != 2:
        raise CustomLossError(f"{where}: the output is (loss, metrics)")
    loss, metrics = args[0]
    if not isinstance(loss, _Ref) or not isinstance(metrics, dict):
        raise CustomLossError(f"{where}: the output is (a tensor, a dict of tensors)")
    for key, value in metrics.items():
        if not (isinstance(key, str) and key.startswith("custom/") and key.endswith(METRIC_SUFFIXES)
                and isinstance(value, _Ref)):
            raise CustomLossError(f"{where}: metric {key!r} must be a tensor named custom/<name>:sum or :mean")
    return loss, metrics


def _decode(value: Any, known: set[str], where: str) -> Any:
    """An encoded argument (tinker.types.CustomLossNode's forms) as a template: _Ref for a node, DEVICE for a
    device, Python values otherwise."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise CustomLossError(f"{where}: a list of {len(value)} operands; at most {MAX_LIST}")
        return [_decode(item, known, where) for item in value]
    if isinstance(value, dict) and len(value) == 1:
        (kind, inner), = value.items()
        if kind == "ref" and inner in known:
            return _Ref(inner)
        if kind == "tuple" and isinstance(inner, list) and len(inner) <= MAX_LIST:
            return tuple(_decode(item, known, where) for item in inner)
        if kind == "dict" and isinstance(inner, dict) and len(inner) <= MAX_LIST:
            return {str(key): _decode(item, known, where) for key, item in inner.items()}
        if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
            return slice(*[_decode(item, known, where) for item in inner])
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        if kind == "dtype" and ops.dtype(str(inner)) is not None:
            return ops.dtype(str(inner))
        if kind == "device":
            return DEVICE
        if kind == "layout" and inner == "strided":
            return torch.strided
        if kind == "memory_format" and inner in ("contiguous_format", "preserve_format"):
            return getattr(torch, inner)
    raise CustomLossError(f"{where}: an argument aspen does not take: {json.dumps(value)[:120]}")


def _resolve(template: Any, values: dict[str, Any], device: torch.device) -> Any:
    if isinstance(template, _Ref):
        return values[template.name]
    if template is DEVICE:
        return device
    if isinstance(template, list):
        return [_resolve(item, values, device) for item in template]
    if isinstance(template, tuple):
        return tuple(_resolve(item, values, device) for item in template)
    if isinstance(template, dict):
        return {key: _resolve(item, values, device) for key, item in template.items()}
    if isinstance(template, slice):
        return slice(*[_resolve(item, values, device) for item in (template.start, template.stop, template.step)])
    return template


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _tensors_of(template: Any, tainted: set[str]) -> bool:
    """Whether a template refers to a tainted value."""
    if isinstance(template, _Ref):
        return template.name in tainted
    if isinstance(template, (list, tuple)):
        return any(_tensors_of(item, tainted) for item in template)
    if isinstance(template, dict):
        return any(_tensors_of(item, tainted) for item in template.values())
    return False


MADE_ON_DEVICE = (torch.arange, torch.tensor, torch.scalar_tensor)


def _placed(step: _Step, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Whatever device a loss names, its tensors are made where its datum's are (the check runs on the host,
    the step on the trainer's device)."""
    if "device" in kwargs or step.call in MADE_ON_DEVICE:
        kwargs = {**kwargs, "device": device}
    if step.call == "to":
        args = tuple(device if isinstance(arg, (str, torch.device)) else arg for arg in args)
    return args, kwargs


def _check_before(step: _Step, args: tuple, kwargs: dict, tainted: set[str], cap: int) -> None:
    """Refuse what could size a tensor by the model's values, index out of range, or make too large a tensor."""
    if step.kind == "method" and not isinstance(args[0] if args else None, torch.Tensor):
        raise CustomLossError(f"calls method {step.call} of a {type(args[0]).__name__ if args else 'nothing'}, "
                              "not of a tensor")
    if getattr(step.call, "__module__", None) in ("_operator", "operator") and step.call is not operator.getitem:
        plain = [arg for arg in args if not isinstance(arg, torch.Tensor)]
        if any(not isinstance(arg, (bool, int, float)) for arg in plain):
            raise CustomLossError("Python arithmetic takes tensors and numbers")
        if step.call is operator.pow and len(plain) == 2 and isinstance(plain[0], int) and abs(plain[1]) > 64:
            raise CustomLossError("an integer power beyond 64")
    if step.call is operator.getitem and len(args) == 2:
        indices = _tensors(args[1])
        if any(index.dtype != torch.bool for index in indices):
            raise CustomLossError("indexes with a non-boolean tensor (an index out of range ends a CUDA process); "
                                  "use boolean masks, slices and integers")
        if indices and _tensors_of(step.args[1], tainted):
            raise CustomLossError("indexes with a mask computed from logprobs, so the result's size would depend "
                                  "on the model's values; use torch.where(mask, x, 0) instead")
    if step.call is torch.where and len(args) + len(kwargs) == 1:
        raise CustomLossError("torch.where(condition) sizes its result by values; give it (condition, x, y)")
    if step.call in (torch.tensor, torch.scalar_tensor) and not (
            len(args) == 1 and isinstance(args[0], (bool, int, float))):
        raise CustomLossError(f"{step.target} takes one number")
    if step.call is torch.arange:
        if not args or len(args) > 3 or not all(isinstance(arg, (int, float)) for arg in args):
            raise CustomLossError("torch.arange takes one to three numbers")
        start, end, stride = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) == 3
                                                                        else 1)
        if stride == 0 or (end - start) / stride > cap:
            raise CustomLossError(f"torch.arange would make more than {cap} elements")
    tensors = _tensors(args) + _tensors(kwargs)
    if len(tensors) > 1:
        try:
            shape = torch.broadcast_shapes(*[tensor.shape for tensor in tensors])
        except RuntimeError:
            return   # not an elementwise operation of them (torch.cat's operands): checked after it runs
        if math.prod(shape) > cap:
            raise CustomLossError(f"its operands broadcast to {tuple(shape)}, more than {cap} elements "
                                  f"({CAP_FACTOR}x the datum's largest operand, at least {MIN_CAP})")


def _check_after(value: Any, cap: int) -> None:
    if isinstance(value, int) and abs(value) > 1 << 62:
        raise CustomLossError(f"an integer beyond 2**62 ({str(value)[:20]}...)")
    for tensor in _tensors(value):
        if tensor.numel() > cap:
            raise CustomLossError(f"it made a tensor of {tuple(tensor.shape)}, more than {cap} elements "
                                  f"({CAP_FACTOR}x the datum's largest operand, at least {MIN_CAP})")


def run_loss(loss: CustomLoss, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The datum's loss and metrics (its inputs by name, float32 on logprobs' device)."""
    return loss.program().run(logprobs, [inputs[name] for name in loss.input_names])


def combine_metrics(per_datum: list[dict[str, float]]) -> dict[str, float]:
    """A call's metrics from its datums': `:sum` summed, `:mean` averaged over the datums (as the SDK's own
    client-side run of the same loss combines them)."""
    totals: dict[str, float] = {}
    for metrics in per_datum:
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    return {key: value / len(per_datum) if key.endswith(":mean") else value for key, value in totals.items()}
