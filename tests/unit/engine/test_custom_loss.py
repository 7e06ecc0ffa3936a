"""actors/engine/custom_loss.py: a loss traced by the `tinker` SDK (`trace_loss`, `encode_graph`, as a user's
`create_custom_loss` sends it), rebuilt from aspen's allowed operations, computes what torch.fx's own
GraphModule of the same trace computes (the loss, its metrics and the gradient of the log-probabilities, bit for
bit: the same operations in the same order); and whatever could harm the trainer or differ inside the step is
refused, naming the node."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actors.engine.custom_loss import MAX_NODES, CustomLoss, CustomLossError, combine_metrics

custom_loss = pytest.importorskip("tinker.lib.public_interfaces.custom_loss")


def traced(fn, ranks: dict[str, int]) -> tuple[CustomLoss, object]:
    """(aspen's rebuilt loss, the SDK's handle whose `graph` is torch.fx's GraphModule)."""
    handle = custom_loss.trace_loss(fn, ranks, "session")
    nodes = [node.model_dump(mode="json") for node in custom_loss.encode_graph(handle).nodes]
    return CustomLoss.of(handle.name, list(ranks.items()), nodes), handle


def ppo_like(logprobs, old, advantages, mask):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -(objective * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": mask.sum()}


def many_operations(logprobs, weights, mask):
    n = logprobs.shape[0]
    positions = torch.arange(n, dtype=torch.float32) / (n + 1)
    soft = F.log_softmax(logprobs, dim=-1) + F.logsigmoid(logprobs) + torch.special.expit(logprobs)
    picked = logprobs[mask > 0].sum() + logprobs[..., None][:, 0].mean()
    kept = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs)).sum()
    values = torch.sort(logprobs.detach()).values
    top = logprobs.max(dim=0).values + torch.logsumexp(logprobs, 0) + values[-1]
    joined = torch.cat([logprobs * weights, positions]).mean() + torch.stack([kept, picked]).sum()
    total = soft.sum() * 0.1 + top + joined + math.log(2.0) + logprobs.float().to(torch.float64).pow(2).mean().float()
    return total, {"custom/top:mean": top}


def top_k(logprobs, weights):   # (N, K) targets: cross_entropy's top-k distillation, written by hand
    return -(logprobs * weights).sum(), {}


@pytest.mark.parametrize("fn, ranks, shapes", [
    (ppo_like, {"logprobs": 1, "old": 1, "advantages": 1, "mask": 1}, [(13,)] * 4),
    (many_operations, {"logprobs": 1, "weights": 1, "mask": 1}, [(9,)] * 3),
    (top_k, {"logprobs": 2, "weights": 2}, [(6, 3), (6, 3)]),
])
def test_the_rebuilt_loss_computes_what_torch_fx_computes(fn, ranks, shapes):
    loss, handle = traced(fn, ranks)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        logprobs = -torch.rand(shapes[0], generator=generator) * 5
        inputs = [torch.randn(shape, generator=generator) for shape in shapes[1:]]
        if "mask" in ranks:
            inputs[-1] = (inputs[-1] > 0).float()
        ours_in, theirs_in = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
        ours, ours_metrics = loss.program().run(ours_in, inputs)
        theirs, theirs_metrics = handle.graph(theirs_in, *inputs)
        assert torch.equal(ours, theirs)
        assert ours_metrics.keys() == theirs_metrics.keys()
        assert all(torch.equal(ours_metrics[key], theirs_metrics[key].detach()) for key in ours_metrics)
        ours.backward()
        theirs.backward()
        assert torch.equal(ours_in.grad, theirs_in.grad)


def test_metrics_combine_as_the_sdk_combines_them():
    per_datum = [{"custom/a:sum": 1.0, "custom/b:mean": 2.0}, {"custom/a:sum": 3.0, "custom/b:mean": 6.0}]
    assert combine_metrics(per_datum) == {"custom/a:sum": 4.0, "custom/b:mean": 4.0}


def nodes_of(fn, ranks):
    handle = custom_loss.trace_loss(fn, ranks, "session")
    return [node.model_dump(mode="json") for node in custom_loss.encode_graph(handle).nodes]


def plain(logprobs):
    return -logprobs.sum(), {}


@pytest.mark.parametrize("change, says", [
    ({"target": "os.system"}, "os.system is not an operation"),
    ({"target": "builtins.eval"}, "builtins.eval is not an operation"),
    ({"target": "torch.load"}, "torch.load is not an operation"),
    ({"target": "torch.nonzero"}, "torch.nonzero is not an operation"),
    ({"target": "torch.gather"}, "torch.gather is not an operation"),
    ({"op": "call_method", "target": "add_"}, "Tensor.add_ is not a method"),
    ({"op": "call_method", "target": "tolist"}, "Tensor.tolist is not a method"),
    ({"op": "call_method", "target": "register_hook"}, "Tensor.register_hook is not a method"),
    ({"op": "get_attr", "target": "weight"}, "no modules, no captured tensors"),
    ({"op": "call_module", "target": "linear"}, "no modules, no captured tensors"),
    ({"target": "getattr", "args": [{"ref": "logprobs"}, "data"]}, "reads an attribute other than"),
    ({"args": [{"ref": "nowhere"}]}, "an argument aspen does not take"),
    ({"args": [{"callable": "print"}]}, "an argument aspen does not take"),
])
def test_a_node_outside_the_allowed_operations_is_refused_naming_it(change, says):
    nodes = nodes_of(plain, {"logprobs": 1})
    assert nodes[1]["op"] == "call_method" and nodes[1]["target"] == "sum"
    nodes[1] = {**nodes[1], "op": "call_function", **change}
    with pytest.raises(CustomLossError, match=f"node '{nodes[1]['name']}'") as refused:
        CustomLoss.of("plain", [("logprobs", 1)], nodes)
    assert says in str(refused.value)


def test_a_graph_that_is_not_a_loss_is_refused():
    nodes = nodes_of(plain, {"logprobs": 1})
    with pytest.raises(CustomLossError, match="placeholders"):
        CustomLoss.of("plain", [("logprobs", 1), ("weights", 1)], nodes)
    with pytest.raises(CustomLossError, match="no output node"):
        CustomLoss.of("plain", [("logprobs", 1)], nodes[:-1])
    with pytest.raises(CustomLossError, match=f"1 to {MAX_NODES} nodes"):
        CustomLoss.of("plain", [("logprobs", 1)], nodes[:1] + nodes[1:2] * MAX_NODES + nodes[-1:])
    bad_metric = [dict(node) for node in nodes]
    bad_metric[-1] = {**bad_metric[-1], "args": [{"tuple": [{"ref": "neg"}, {"dict": {"loss": {"ref": "neg"}}}]}]}
    with pytest.raises(CustomLossError, match="custom/<name>:sum or :mean"):
        CustomLoss.of("plain", [("logprobs", 1)], bad_metric)


def check(fn, ranks, shapes: dict[str, tuple[int, ...]], inputs: dict[str, torch.Tensor] | None = None) -> None:
    loss = CustomLoss.of(fn.__name__, list(ranks.items()), nodes_of(fn, ranks))
    given = inputs if inputs is not None else {name: torch.ones(shape) for name, shape in shapes.items()
                                               if name != "logprobs"}
    loss.check_datum(given, shapes["logprobs"], 4)


def test_what_could_differ_in_the_step_or_harm_the_trainer_fails_its_check_naming_the_datum_and_node():
    def value_sized(logprobs):   # a mask of the model's values sizes the result: not known before the step
        return logprobs[logprobs > -1.0].sum(), {}

    def integer_index(logprobs, positions):
        return logprobs[positions.long()].sum(), {}

    def grows(logprobs):
        return (logprobs[:, None, None] * logprobs[None, :, None] * logprobs[None, None, :]).sum(), {}

    def long_range(logprobs):
        return logprobs.sum() + torch.arange(logprobs.shape[0] * 10 ** 7, dtype=torch.float32).sum(), {}

    def not_scalar(logprobs):
        return -logprobs, {}

    def one_argument_where(logprobs):
        return torch.where(logprobs > 0)[0].float().sum(), {}

    cases = [(value_sized, {"logprobs": 1}, "a mask computed from logprobs"),
             (integer_index, {"logprobs": 1, "positions": 1}, "non-boolean tensor"),
             (grows, {"logprobs": 1}, "broadcast to (128, 128, 128)"),
             (long_range, {"logprobs": 1}, "torch.arange would make more than"),
             (not_scalar, {"logprobs": 1}, "must return a scalar"),
             (one_argument_where, {"logprobs": 1}, "torch.where(condition)")]
    for fn, ranks, says in cases:
        shapes = {name: (128,) for name in ranks}
        with pytest.raises(CustomLossError, match="datum 4") as refused:
            check(fn, ranks, shapes)
        assert says in str(refused.value) and fn.__name__ in str(refused.value), refused.value


def test_inputs_of_another_rank_or_missing_are_refused():
    def weighted(logprobs, weights):
        return -(logprobs * weights).sum(), {}

    with pytest.raises(CustomLossError, match="lacks 'weights'"):
        check(weighted, {"logprobs": 1, "weights": 1}, {"logprobs": (5,)}, inputs={})
    with pytest.raises(CustomLossError, match="'weights' has rank 2"):
        check(weighted, {"logprobs": 1, "weights": 1}, {"logprobs": (5,)}, inputs={"weights": torch.ones(5, 2)})
    with pytest.raises(CustomLossError, match="target_tokens has rank 2"):
        check(weighted, {"logprobs": 1, "weights": 1}, {"logprobs": (5, 2)}, inputs={"weights": torch.ones(5)})


def test_a_loss_naming_a_device_makes_its_tensors_on_its_datums_device():
    def on_cpu(logprobs):
        made = torch.zeros_like(logprobs, device="cpu") + torch.arange(logprobs.shape[0], device="cpu")
        return (logprobs.to("cpu") * made).sum(), {}

    loss = CustomLoss.of("on_cpu", [("logprobs", 1)], nodes_of(on_cpu, {"logprobs": 1}))
    meta = torch.zeros(4, device="meta")   # a device other than the one the loss names
    value, _ = loss.program().run(meta, [])
    assert value.device.type == "meta"


def by_hand(*steps: dict) -> CustomLoss:
    """A graph sent by hand (not through the SDK's tracer): logprobs, the given steps, then the loss
    `-logprobs.sum()` so that it is a loss."""
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
             *[{"args": [], "kwargs": {}, **step} for step in steps],
             {"op": "call_method", "name": "total", "target": "sum", "args": [{"ref": "logprobs"}], "kwargs": {}},
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "total"}, {"dict": {}}]}], "kwargs": {}}]
    return CustomLoss.of("by_hand", [("logprobs", 1)], nodes)


@pytest.mark.parametrize("step, says", [
    ({"op": "call_function", "name": "bomb", "target": "operator.mul", "args": ["a", 10 ** 12]},
     "Python arithmetic takes tensors and numbers"),
    ({"op": "call_function", "name": "huge", "target": "operator.pow", "args": [3, 10 ** 9]},
     "an integer power beyond 64"),
    ({"op": "call_method", "name": "method", "target": "sum", "args": [5]}, "not of a tensor"),
    ({"op": "call_function", "name": "attribute", "target": "getattr", "args": [5, "shape"]},
     "AttributeError"),
])
def test_python_values_a_hand_made_graph_computes_stay_bounded(step, says):
    loss = by_hand(step)
    with pytest.raises(CustomLossError, match=f"node '{step['name']}'") as refused:
        loss.check_datum({}, (4,), 0)
    assert says in str(refused.value)


def test_a_call_whose_datums_would_run_too_many_operations_is_refused_saying_how_many_it_may_send():
    from actors.engine.custom_loss import MAX_CALL_OPERATIONS

    loss = CustomLoss.of("ppo_like", [("logprobs", 1), ("old", 1), ("advantages", 1), ("mask", 1)],
                         nodes_of(ppo_like, {"logprobs": 1, "old": 1, "advantages": 1, "mask": 1}))
    each = len(loss.program().steps)
    loss.check_call_size(MAX_CALL_OPERATIONS // each)
    with pytest.raises(CustomLossError, match=f"send at most {MAX_CALL_OPERATIONS // each} datums a call"):
        loss.check_call_size(MAX_CALL_OPERATIONS // each + 1)
