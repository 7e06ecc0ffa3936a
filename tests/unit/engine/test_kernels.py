"""The `kernels` setting (actors/engine/kernels.py): `none` leaves the model as transformers built it, `auto` on
a CPU applies nothing and on CUDA chooses Liger in a half dtype only, `liger` without Liger-Kernel names the extra
to install, `liger` on a CPU (without Triton's interpreter) is refused, and an architecture Liger's kernels are
not applied to keeps its own operations and says so, once.

Liger's kernels themselves against the model's own operations: tests/unit/engine/test_kernels_interpreted.py,
which runs in a process of its own under Triton's interpreter (started here, where Liger-Kernel is installed:
the `gpu` extra; skipped without it), and tests/gpu/test_kernels_cuda.py in bfloat16 on a GPU."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from actors.engine import kernels
from actors.engine.extras import MissingExtraError
from actors.engine.loss import fused_loss, use_fused_loss
from actors.engine.models import from_module
from actors.service.scheduler.config import TrainerConfig, run_service_config
from actors.spec.run_spec import RunSpec
from tests.helpers.kernels import forwards_rebound, tiny
from tests.helpers.triton_interpreter import interpreter_on, liger_installed, run_interpreted

INTERPRETED = "tests/unit/engine/test_kernels_interpreted.py"

# -- the setting, everywhere --------------------------------------------------------------------------------------

def mlps(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if name.endswith(".mlp")]


def test_none_leaves_the_model_untouched():
    """Its weights and operations as transformers built them; only the MLPs' forwards are rebound to the lean
    SwiGLU, which computes the same values keeping less (tests/unit/engine/test_swiglu.py)."""
    model = tiny("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    base = from_module(model, None, kernels="none")
    assert base.kernels == "none"
    assert forwards_rebound(model) == mlps(model) != []
    assert fused_loss(model.get_output_embeddings().weight) is None
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_auto_on_a_cpu_applies_nothing():
    model = tiny("llama")
    assert from_module(model, None, kernels="auto").kernels == "none"
    assert forwards_rebound(model) == mlps(model)   # the lean SwiGLU only
    assert fused_loss(model.get_output_embeddings().weight) is None


def test_liger_without_liger_kernel_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)   # as if not installed
    monkeypatch.setattr(kernels, "_liger", None)
    with pytest.raises(MissingExtraError) as error:
        from_module(tiny("llama"), None, kernels="liger")
    message = str(error.value)
    assert "kernels: liger" in message and "pip install 'aspen-lora[gpu]'" in message
    assert "[all]" not in message   # the gpu extra is not part of all


def test_liger_on_a_cpu_is_refused_without_triton_s_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "_functional", lambda: types.SimpleNamespace())   # as if installed
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernels: liger needs the base on a CUDA GPU"):
        from_module(tiny("llama"), None, kernels="liger")
    with pytest.raises(ValueError, match="kernels must be one of auto, liger, none"):
        from_module(tiny("llama"), None, kernels="triton")


def test_auto_chooses_liger_only_on_cuda_in_a_half_dtype(monkeypatch):
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels.resolve_kernels("auto", cuda, torch.bfloat16) == "liger"
    assert kernels.resolve_kernels("auto", cuda, torch.float16) == "liger"
    assert kernels.resolve_kernels("auto", cuda, torch.float32) == "none"
    assert kernels.resolve_kernels("auto", cpu, torch.bfloat16) == "none"
    monkeypatch.setattr(kernels, "liger_installed", lambda: False)
    assert kernels.resolve_kernels("auto", cuda, torch.bfloat16) == "none"


def test_an_architecture_without_liger_s_kernels_keeps_its_own_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_functional", lambda: types.SimpleNamespace())   # never called: nothing swapped
    monkeypatch.setattr(kernels, "_told", set())
    model = tiny("gemma")   # GeGLU MLP, RMSNorm with a (1 + weight) offset: not Llama's
    with caplog.at_level(logging.WARNING, logger="actors.engine.kernels"):
        applied = kernels.apply_liger(model)
        kernels.apply_liger(tiny("gemma", seed=1))   # said once
    assert applied == ("loss",)
    assert forwards_rebound(model) == []
    assert fused_loss(model.get_output_embeddings().weight) == "liger"
    said = [record.getMessage() for record in caplog.records if "model_type 'gemma'" in record.getMessage()]
    assert len(said) == 1 and "only the loss is fused" in said[0]


def test_a_model_without_the_expected_modules_is_refused_before_anything_is_swapped(monkeypatch):
    monkeypatch.setattr(kernels, "_functional", lambda: types.SimpleNamespace(liger_rope=None))
    model = tiny("llama")
    for layer in model.model.layers:
        layer.mlp = torch.nn.Identity()   # not LlamaMLP: nothing for SwiGLU to replace
    with pytest.raises(ValueError, match="has no swiglu module"):
        kernels.apply_liger(model)
    assert forwards_rebound(model) == []


def test_the_setting_reaches_the_trainer_and_stages_refuse_liger():
    spec = RunSpec(jobs=[{"name": "a", "data": "a.jsonl", "format": {"type": "text"}}], kernels="none")
    assert run_service_config(spec).trainers[0].kernels == "none"
    assert TrainerConfig().kernels == "auto"
    with pytest.raises(ValueError, match="stages >= 2 runs its stages without fused kernels"):
        TrainerConfig(stages=2, kernels="liger")


def test_the_fused_loss_mark_is_the_model_s_own():
    weight, other = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(4, 2))
    use_fused_loss(weight, "liger")
    assert fused_loss(weight) == "liger" and fused_loss(other) is None
    with pytest.raises(ValueError, match="fused loss kernel must be one of liger"):
        use_fused_loss(weight, "cuda")




@pytest.mark.long   # ~55 s on CI's machine: Liger's Triton kernels run by Triton's interpreter, in a process of its own
@pytest.mark.skipif(not liger_installed(), reason="Liger-Kernel is not installed (pip install 'aspen-lora[gpu]')")
@pytest.mark.skipif(interpreter_on(), reason=f"this process runs under Triton's interpreter: {INTERPRETED} runs here")
def test_liger_s_kernels_under_triton_s_interpreter():
    """tests/unit/engine/test_kernels_interpreted.py in a process started with TRITON_INTERPRET=1: all of it passes,
    none of it skipped."""
    run_interpreted(INTERPRETED, timeout=1200)
