"""A pipeline stage's dispatch, without a model or a transport: every kind of operation the schedule places
and every kind of message the head sends has its one handler, the short words still find theirs, and a
kind without one is refused, named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.engine.pipeline.pipeline_schedule import Op, OpKind
from actors.engine.pipeline.stage import StageRuntime
from actors.engine.pipeline.stage_messages import StageMessageKind, StageSettings


def runtime() -> StageRuntime:
    model = SimpleNamespace(stage=0, stages=2, last=False, base=SimpleNamespace(device=torch.device("cpu")))
    return StageRuntime(model, links=SimpleNamespace(waited=0.0), settings=StageSettings())


def test_every_operation_and_message_kind_has_its_handler():
    stage = runtime()
    assert set(stage.OPERATIONS) == set(OpKind)
    assert set(stage.MESSAGES) == set(StageMessageKind) - {StageMessageKind.STOP}   # stop ends the process
    assert len(set(stage.OPERATIONS.values())) == len(OpKind)
    assert all(callable(getattr(stage, name)) for name in (*stage.OPERATIONS.values(), *stage.MESSAGES.values()))


def test_the_short_words_are_the_kinds():
    assert OpKind.FORWARD_BACKWARD == "FB" and OpKind.OPTIMIZER_STEP == "O" and StageMessageKind.EVALUATE == "eval"
    stage = runtime()
    assert stage.MESSAGES["drain"] == stage.MESSAGES[StageMessageKind.DRAIN]
    assert stage.handle(("drain",)) is None   # nothing fed: nothing to run


def test_an_unknown_kind_is_refused_naming_it():
    stage = runtime()
    with pytest.raises(ValueError, match="unknown pipeline message 'nonsense'"):
        stage.handle(("nonsense",))
    stage.schedule.ops[0].append(Op(kind="Z", stage=0))
    with pytest.raises(ValueError, match="no handler for operation kind 'Z'"):
        stage.run_ops()
