"""Choosing a kernel by measuring it (actors/engine/kernel_tuning.py): the candidates take a shape's calls in turn,
timed by CUDA events read only once the GPU has passed them (here a fake clock and fake events: the choice is the
host's logic, and a host wait fails the test) and by the host's clock; the step keeps the default's results until
the choice, which is made at a step's start: the least median GPU plus host time; a candidate that fails is left
out with a warning, a failing default raises."""

from __future__ import annotations

import logging

import pytest
import torch

from actors.engine import kernel_tuning
from actors.engine.layout import step_layout
from tests.helpers.lora_bounds import layout_of

COSTS = {"grouped_mm": 3.0, "split_k:1024": 1.0, "split_k:2048": 2.0}   # ms each call takes on the fake GPU
HOST = {"grouped_mm": 0.01, "split_k:1024": 0.02, "split_k:2048": 0.02}   # ms each call takes the fake host
NAMES = list(COSTS)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU clock each candidate's call advances by its cost, a host clock likewise; events that record the GPU's
    and that the GPU `passes` only when the test says; `run(name)` returning which candidate ran. A host wait
    raises."""
    state = {"clock": 0.0, "host": 0.0, "passed": False, "ran": [], "host_costs": dict(HOST)}

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            self.at = state["clock"]

        def query(self) -> bool:
            return state["passed"]

        def elapsed_time(self, end: Event) -> float:
            assert state["passed"], "read before the GPU passed it"
            return end.at - self.at

        def synchronize(self):
            raise AssertionError("the host waited for an event")

    def run(name):
        if name == "broken":
            raise RuntimeError("out of resource: shared memory")
        state["clock"] += COSTS[name]
        state["host"] += state["host_costs"][name] / 1e3
        state["ran"].append(name)
        return torch.full((1,), float(NAMES.index(name)))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError("synchronize")))
    monkeypatch.setattr(kernel_tuning, "perf_counter", lambda: state["host"])
    monkeypatch.setattr(kernel_tuning, "TUNINGS", {})
    state["run"] = run
    return state


def tuning(*names: str) -> kernel_tuning.Tuning:
    found = kernel_tuning.TUNINGS[("x",)] = kernel_tuning.Tuning("x A^T, 4096 features", list(names or NAMES))
    return found


def test_candidates_take_the_calls_in_turn_and_the_least_median_wins_once_the_gpu_passed_them(fake_gpu, caplog):
    shape = tuning()
    calls = 3 * (1 + kernel_tuning.SAMPLES) + 6
    results = [int(kernel_tuning.measured(shape, fake_gpu["run"])) for _ in range(calls)]
    # the candidates in turn, each run first; every call's result the default's (measuring changes no number)
    expected = []
    for index in range(calls):
        name = NAMES[index % 3]
        expected += [name] if name == "grouped_mm" else [name, "grouped_mm"]
    assert fake_gpu["ran"] == expected and results == [0] * calls
    assert shape.chosen is None and len(shape.pending) == calls - 3   # the first call of each untimed
    fake_gpu["passed"] = True
    with caplog.at_level(logging.INFO):
        assert int(kernel_tuning.measured(shape, fake_gpu["run"])) == 1
    assert shape.chosen == "split_k:1024" and not shape.pending
    assert any("x A^T, 4096 features takes split_k:1024" in record.getMessage() for record in caplog.records)
    decision = kernel_tuning.decisions()["x A^T, 4096 features"]
    assert decision["chosen"] == "split_k:1024" and decision["median_ms"] == COSTS
    assert decision["host_median_ms"] == pytest.approx(HOST)


def test_a_kernel_that_saves_the_gpu_less_than_it_costs_the_host_loses(fake_gpu):
    fake_gpu["host_costs"]["split_k:1024"] = 2.5   # 1 ms of GPU + 2.5 of host against grouped_mm's 3 + 0.01
    shape = tuning()
    for _ in range(3 * (1 + kernel_tuning.SAMPLES)):
        kernel_tuning.measured(shape, fake_gpu["run"])
    fake_gpu["passed"] = True
    shape.read()
    assert shape.chosen == "split_k:2048"   # 2 + 0.02


def test_the_choice_is_made_at_a_step_s_start_so_a_step_computes_a_shape_one_way(fake_gpu):
    shape = tuning()
    fake_gpu["passed"] = True
    with step_layout(layout_of()):
        results = [int(kernel_tuning.measured(shape, fake_gpu["run"])) for _ in range(3 * (2 + kernel_tuning.SAMPLES))]
    assert shape.chosen is None and results == [0] * len(results)   # samples enough, but the step went on
    with step_layout(layout_of()):   # the next step
        assert [int(kernel_tuning.measured(shape, fake_gpu["run"])) for _ in range(2)] == [1, 1]
    assert shape.chosen == "split_k:1024"


def test_no_choice_before_every_candidate_has_its_samples(fake_gpu):
    shape = tuning()
    fake_gpu["passed"] = True
    for _ in range(3 * kernel_tuning.SAMPLES):   # 3 untimed + 3 x (samples - 1) timed calls so far
        kernel_tuning.measured(shape, fake_gpu["run"])
    shape.read()
    assert shape.chosen is None
    for _ in range(3):
        kernel_tuning.measured(shape, fake_gpu["run"])
    shape.read()
    assert shape.chosen == "split_k:1024"


def test_a_candidate_that_fails_is_left_out_with_a_warning_and_the_call_answered(fake_gpu, caplog):
    shape = tuning("grouped_mm", "broken")
    with caplog.at_level(logging.WARNING):
        kernel_tuning.measured(shape, fake_gpu["run"])            # grouped_mm's untimed first call
        result = kernel_tuning.measured(shape, fake_gpu["run"])   # "broken": fails, answered by grouped_mm instead
    assert fake_gpu["ran"][-1] == "grouped_mm" and int(result) == 0
    assert shape.candidates == ["grouped_mm"] and shape.chosen == "grouped_mm"
    assert any("broken failed" in record.getMessage() and "shared memory" in record.getMessage()
               for record in caplog.records)


def test_a_failing_default_is_not_swallowed(fake_gpu):
    def failing(name):
        raise RuntimeError("grouped_mm broke")

    with pytest.raises(RuntimeError, match="grouped_mm broke"):
        kernel_tuning.measured(tuning("grouped_mm", "split_k:1024"), failing)


def test_a_lone_candidate_is_chosen_at_once(fake_gpu):
    shape = tuning("grouped_mm")
    assert shape.chosen == "grouped_mm" and int(kernel_tuning.measured(shape, fake_gpu["run"])) == 0
