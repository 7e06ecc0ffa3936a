"""The fused multi-LoRA layer against a plain-math reference, dropout backward included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.engine import lora_grouped
from actors.engine.adapter_surgery import add_adapter, remove_adapter, resolve_targets
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig
from tests.helpers.models import tiny_model


def _layer_with_adapters(configs: dict[str, LoraConfig]) -> FusedLoraLinear:
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    base.requires_grad_(False)
    layer = FusedLoraLinear(base)
    for i, (name, config) in enumerate(configs.items()):
        adapter = LoraAdapter(16, 12, config, generator=torch.Generator().manual_seed(i), device=torch.device("cpu"))
        with torch.no_grad():
            adapter.lora_B.normal_()
        adapter.dropout_generator = torch.Generator().manual_seed(100 + i)
        layer.adapters[name] = adapter
    return layer


def test_each_adapter_touches_only_its_segment_and_matches_the_formula():
    configs = {"a": LoraConfig(r=4, alpha=8), "b": LoraConfig(r=2, alpha=2, use_rslora=True)}
    layer = _layer_with_adapters(configs)
    x = torch.randn(1, 10, 16)
    with step_layout(StepLayout((("a", 0, 6), ("b", 6, 10)), ((0, 6), (6, 10)), 10)):
        out = layer(x)
    a, b = layer.adapters["a"], layer.adapters["b"]
    ref_a = layer.base(x[0, :6]) + x[0, :6] @ a.lora_A.T @ a.lora_B.T * (8 / 4)
    ref_b = layer.base(x[0, 6:]) + x[0, 6:] @ b.lora_A.T @ b.lora_B.T * (2 / 2 ** 0.5)
    torch.testing.assert_close(out[0, :6], ref_a)
    torch.testing.assert_close(out[0, 6:], ref_b)


def test_gap_between_segments_gets_base_output_only():
    layer = _layer_with_adapters({"a": LoraConfig(r=4, alpha=8)})
    x = torch.randn(1, 9, 16)
    with step_layout(StepLayout((("other", 0, 3), ("a", 3, 6), ("other2", 6, 9)), ((0, 9),), 9)):
        out = layer(x)
    torch.testing.assert_close(out[0, :3], layer.base(x[0, :3]))
    torch.testing.assert_close(out[0, 6:], layer.base(x[0, 6:]))


def test_dropout_backward_uses_the_forward_mask():
    """Gradients with dropout equal those of the explicit formula with the very mask drawn in forward."""
    config = LoraConfig(r=4, alpha=8, dropout=0.5)
    layer = _layer_with_adapters({"a": config})
    adapter = layer.adapters["a"]
    adapter.train(True)
    x = torch.randn(1, 7, 16, requires_grad=True)
    upstream = torch.randn(1, 7, 12)
    # Draw the mask the layer will draw, from a copy of the adapter's generator.
    generator_copy = torch.Generator().set_state(adapter.dropout_generator.get_state())
    keep = torch.empty(7, 16).bernoulli_(0.5, generator=generator_copy) / 0.5
    assert 0 < int((keep == 0).sum()) < keep.numel()
    with step_layout(StepLayout((("a", 0, 7),), ((0, 7),), 7)):
        (layer(x) * upstream).sum().backward()
    got = (x.grad.clone(), adapter.lora_A.grad.clone(), adapter.lora_B.grad.clone())

    x_ref = x.detach().clone().requires_grad_(True)
    a_ref = adapter.lora_A.detach().clone().requires_grad_(True)
    b_ref = adapter.lora_B.detach().clone().requires_grad_(True)
    y_ref = layer.base(x_ref[0]) + ((x_ref[0] * keep) @ a_ref.T) @ b_ref.T * config.scaling
    (y_ref * upstream[0]).sum().backward()
    torch.testing.assert_close(got[0], x_ref.grad)
    torch.testing.assert_close(got[1], a_ref.grad)
    torch.testing.assert_close(got[2], b_ref.grad)
    # and the mask is not ignored: without it the gradient of A differs
    a_nomask = adapter.lora_A.detach().clone().requires_grad_(True)
    ((layer.base(x_ref[0].detach()) + (x_ref[0].detach() @ a_nomask.T) @ b_ref.detach().T * config.scaling)
     * upstream[0]).sum().backward()
    assert not torch.allclose(a_nomask.grad, got[1])


def test_dropout_is_off_in_eval_mode():
    layer = _layer_with_adapters({"a": LoraConfig(r=4, alpha=8, dropout=0.9)})
    layer.adapters.train(False)
    x = torch.randn(1, 5, 16)
    with step_layout(StepLayout((("a", 0, 5),), ((0, 5),), 5)):
        first, second = layer(x), layer(x)
    torch.testing.assert_close(first, second)


def test_adapters_added_and_removed_at_run_time_without_touching_the_base():
    model = tiny_model("llama", vocab_size=300)
    model.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain_type = type(model.model.layers[0].self_attn.q_proj)
    a = add_adapter(model, "a", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=0)
    b = add_adapter(model, "b", LoraConfig(r=2, target_modules="all-linear"), seed=1)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, FusedLoraLinear) and set(q_proj.adapters) == {"a", "b"}
    assert len(a.layers) == 2 * 2 and len(b.layers) == 2 * 7  # 2 layers x (q,v) and x all 7 linears
    assert all(p.requires_grad for p in a.parameters() + b.parameters())
    with pytest.raises(ValueError, match="already attached"):
        add_adapter(model, "a", LoraConfig(), seed=0)
    remove_adapter(model, "a")
    assert set(model.model.layers[0].self_attn.q_proj.adapters) == {"b"}
    remove_adapter(model, "b")
    assert type(model.model.layers[0].self_attn.q_proj) is plain_type
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_unknown_target_module_names_the_available_ones():
    model = tiny_model("llama", vocab_size=300)
    with pytest.raises(ValueError, match=r"'qproj' matches no linear layer.*q_proj"):
        resolve_targets(model, ["qproj"])
    assert "lm_head" not in resolve_targets(model, "all-linear")


def _grouped_and_segment_runs(monkeypatch, layer, x, layout, upstream):
    """Output and gradients (x, every A and B) of the layer, computed grouped and per segment."""
    results = {}
    for mode in ("grouped", "segments"):
        monkeypatch.setattr(lora_grouped, "GROUPING", mode)
        for adapter in layer.adapters.values():
            adapter.lora_A.grad = adapter.lora_B.grad = None
            if adapter.dropout_generator is not None:
                adapter.dropout_generator.manual_seed(7)
        x_run = x.detach().clone().requires_grad_(True)
        with step_layout(layout):
            out = layer(x_run)
        (out * upstream).sum().backward()
        results[mode] = {"out": out.detach(), "x": x_run.grad,
                         **{f"{name}.{which}": getattr(adapter, f"lora_{which}").grad.clone()
                            for name, adapter in layer.adapters.items() for which in "AB"}}
    return results


def test_grouped_adapters_equal_per_segment_adapters_forward_and_backward(monkeypatch):
    """The batched (grouped) way: different ranks and scalings, dropout on one adapter, a gap of tokens
    whose job has no adapter here, segments of different lengths: same output and gradients as per
    segment, and the output matches the formula."""
    configs = {"a": LoraConfig(r=4, alpha=8, dropout=0.3), "b": LoraConfig(r=2, alpha=2, use_rslora=True),
               "c": LoraConfig(r=8, alpha=4)}
    layer = _layer_with_adapters(configs)
    layer.adapters.train(True)
    x = torch.randn(1, 19, 16)
    layout = StepLayout((("a", 0, 6), ("gap", 6, 9), ("b", 9, 13), ("c", 13, 19)), ((0, 9), (9, 19)), 19)
    upstream = torch.randn(1, 19, 12)
    results = _grouped_and_segment_runs(monkeypatch, layer, x, layout, upstream)
    for key in results["segments"]:
        torch.testing.assert_close(results["grouped"][key], results["segments"][key], msg=key)
    b, c = layer.adapters["b"], layer.adapters["c"]
    out = results["grouped"]["out"][0]
    torch.testing.assert_close(out[6:9], layer.base(x[0, 6:9]))
    torch.testing.assert_close(out[9:13], layer.base(x[0, 9:13]) + x[0, 9:13] @ b.lora_A.T @ b.lora_B.T * 2 ** 0.5)
    torch.testing.assert_close(out[13:], layer.base(x[0, 13:]) + x[0, 13:] @ c.lora_A.T @ c.lora_B.T * 0.5)


def test_grouped_adapters_on_equal_back_to_back_segments_equal_per_segment(monkeypatch):
    """The grouped way's regular case (equal segments covering the stream in order: the batch is a view of the
    stream, the result added as it lies), three rank buckets (2; 4, 4; 8), dropout on two adapters: same output
    and gradients as per segment, the output the formula."""
    configs = {"a": LoraConfig(r=2, alpha=8, dropout=0.3), "b": LoraConfig(r=4, alpha=2, use_rslora=True),
               "c": LoraConfig(r=4, alpha=2), "d": LoraConfig(r=8, alpha=16, dropout=0.1)}
    layer = _layer_with_adapters(configs)
    layer.adapters.train(True)
    x = torch.randn(1, 20, 16)
    layout = StepLayout((("a", 0, 5), ("b", 5, 10), ("c", 10, 15), ("d", 15, 20)), ((0, 10), (10, 20)), 20)
    results = _grouped_and_segment_runs(monkeypatch, layer, x, layout, torch.randn(1, 20, 12))
    for key in results["segments"]:
        torch.testing.assert_close(results["grouped"][key], results["segments"][key], msg=key)
    groups = [value for value in layout.tensors.values() if isinstance(value, lora_grouped.SegmentGroup)]
    assert [group.regular for group in groups] == [True]
    c = layer.adapters["c"]
    torch.testing.assert_close(results["grouped"]["out"][0, 10:15],
                               layer.base(x[0, 10:15]) + x[0, 10:15] @ c.lora_A.T @ c.lora_B.T * 0.5)


@pytest.mark.parametrize("mode", ["grouped", "segments"])
def test_nan_in_one_jobs_tokens_never_reaches_another_adapter(monkeypatch, mode):
    """Isolation in the worst case: a job whose activations are NaN leaves the other adapters' outputs
    and gradients exactly as they are without that job's NaN."""
    monkeypatch.setattr(lora_grouped, "GROUPING", mode)
    layer = _layer_with_adapters({"a": LoraConfig(r=4, alpha=8), "b": LoraConfig(r=4, alpha=8)})
    layout = StepLayout((("a", 0, 5), ("b", 5, 12)), ((0, 5), (5, 12)), 12)
    x = torch.randn(1, 12, 16)
    upstream = torch.randn(1, 12, 12)
    grads = []
    for poison in (False, True):
        x_run = x.clone()
        up = upstream.clone()
        if poison:
            x_run[0, 5:] = float("nan")
            up[0, 5:] = float("nan")
        for adapter in layer.adapters.values():
            adapter.lora_A.grad = adapter.lora_B.grad = None
        x_run.requires_grad_(True)
        with step_layout(layout):
            out = layer(x_run)
        (out * up).sum().backward()
        a = layer.adapters["a"]
        grads.append((out[0, :5].detach(), a.lora_A.grad.clone(), a.lora_B.grad.clone(), x_run.grad[0, :5].clone()))
    for clean, poisoned in zip(*grads, strict=True):
        assert torch.isfinite(poisoned).all()
        assert torch.equal(clean, poisoned)


def test_jobs_may_be_named_like_module_attributes():
    """'train', 'half', 'cuda' are nn.Module attributes; a job of that name still gets its adapter."""
    from actors.engine.adapter_surgery import add_adapter, remove_adapter
    from actors.spec.lora_config import LoraConfig
    from tests.helpers.models import tiny_model

    model = tiny_model("llama", vocab_size=300)
    plain = {name for name, _ in model.named_modules()}
    for name in ("train", "half", "cuda", "forward"):
        handle = add_adapter(model, name, LoraConfig(r=2, target_modules=["q_proj"]), seed=0)
        assert handle.parameters()
    for name in ("train", "half", "cuda", "forward"):
        remove_adapter(model, name)
    assert {name for name, _ in model.named_modules()} == plain


def test_the_base_and_adapters_stay_registered_submodules_when_looked_up_directly():
    """`base` and `adapters` are also plain attributes (a lookup without nn.Module's `__getattr__`): a replaced
    base is the one the layer computes with and the one its state dict, `.modules()` and `.to()` see."""
    first, second = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    layer = FusedLoraLinear(first)
    assert layer.__dict__["base"] is first and layer._modules["base"] is first
    layer.base = second
    assert layer.base is second and layer._modules["base"] is second
    assert list(layer.state_dict()) == ["base.weight"]
    assert torch.equal(layer.state_dict()["base.weight"], second.weight)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), second(x))   # no step layout: the base alone
    layer.to(torch.float64)
    assert layer.base.weight.dtype == torch.float64 and layer.base is second
    assert [name for name, _ in layer.named_children()] == ["base", "adapters"]
    del layer.base
    assert "base" not in layer.__dict__ and "base" not in layer._modules
