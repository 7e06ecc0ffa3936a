"""One interface for what the trainer loop steps (actors/service/trainer/step_engine.py): one device's
FusedTrainer and a
pipeline trainer's PipelineEngine each implement every member of `StepEngine`, and the loop asks neither which
it holds (no isinstance or getattr on its engine)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.service.pipeline.pipeline_engine import PipelineEngine
from actors.service.trainer.step_engine import StepEngine
from tests.helpers.models import tiny_model

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]


def members() -> tuple[set[str], set[str]]:
    """(methods and properties, annotated attributes) of the protocol."""
    attributes = set(StepEngine.__annotations__)
    callables = {name for name, value in vars(StepEngine).items()
                 if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return callables, attributes


def assigned_in_init(cls: type) -> set[str]:
    tree = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}


def test_both_engines_implement_every_member():
    callables, attributes = members()
    assert {"compose", "run_step", "rollouts", "rebuild", "close", "generation_refusal", "decode"} <= callables
    for cls in (FusedTrainer, PipelineEngine):
        missing = [name for name in callables if not hasattr(cls, name) and name not in assigned_in_init(cls)]
        assert not missing, f"{cls.__name__} lacks {missing}"
        unset = [name for name in attributes if not hasattr(cls, name) and name not in assigned_in_init(cls)]
        assert not unset, f"{cls.__name__} never sets {unset}"
    trainer = FusedTrainer(from_module(tiny_model("llama"), None))
    assert isinstance(trainer, StepEngine)
    assert trainer.generation_refusal is None and trainer.lost is None
    assert PipelineEngine.generation_refusal is None   # both decode (a pipeline over its stages)


def test_the_loop_never_asks_which_engine_it_holds():
    for module in ("actors/service/trainer/trainer_loop.py", "actors/service/trainer/job_ends.py",
                   "actors/service/trainer/step_booking.py"):
        tree = ast.parse((REPO / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "isinstance", "getattr", "hasattr"):
                target = ast.unparse(node.args[0])
                assert "trainer" not in target and "admission" not in target, f"{module}: {ast.unparse(node)}"
