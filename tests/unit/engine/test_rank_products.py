"""How the rank-wide LoRA products choose their kernel (actors/engine/rank_products.py): the candidates take a shape's
calls in turn and are timed by CUDA events read only once the GPU has passed them (here a fake clock and fake events:
the choice logic is the host's, and a host wait fails the test), the least median wins, a candidate that fails is
left out with a warning; on a CPU `auto` is grouped_mm. The kernel itself runs under Triton's interpreter in a
process of its own (test_rank_products_interpreted.py, started here) and on a GPU in tests/gpu."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from actors.engine import rank_products
from tests.helpers.triton_interpreter import run_interpreted

COSTS = {"grouped_mm": 3.0, "split_k:1024": 1.0, "split_k:2048": 2.0}   # ms each call takes on the fake GPU
HOST = {"grouped_mm": 0.01, "split_k:1024": 0.02, "split_k:2048": 0.02}   # ms each call takes the fake host
KEY = (True, 4096, 48, 3, torch.bfloat16, 0)   # 4 to 7 groups


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU clock each candidate's call advances by its cost; events that record it and that the GPU `passes` only
    when the test says; `_run` returning which candidate ran. Any host wait raises."""
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

    def run(name, left, weights, offsets, transposed):
        if name == "broken":
            raise RuntimeError("out of resource: shared memory")
        state["clock"] += COSTS[name]
        state["host"] += state["host_costs"][name] / 1e3
        state["ran"].append(name)
        return torch.full((1,), float(list(COSTS).index(name)))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError("synchronize")))
    monkeypatch.setattr(rank_products, "_run", run)
    monkeypatch.setattr(rank_products, "perf_counter", lambda: state["host"])
    monkeypatch.setattr(rank_products, "_TUNINGS", {})
    return state


def call(tuning):
    return rank_products._measure(tuning, KEY, torch.empty(0), None, None, True)


def test_candidates_take_the_calls_in_turn_and_the_least_median_wins_once_the_gpu_passed_them(fake_gpu, caplog):
    tuning = rank_products._Tuning(list(COSTS))
    rank_products._TUNINGS[KEY] = tuning
    calls = 3 * (1 + rank_products.TUNING_SAMPLES) + 6
    results = [int(call(tuning)) for _ in range(calls)]
    # the candidates in turn, each run first; every call's result grouped_mm's (measuring changes no number)
    expected = []
    for index in range(calls):
        name = list(COSTS)[index % 3]
        expected += [name] if name == "grouped_mm" else [name, "grouped_mm"]
    assert fake_gpu["ran"] == expected
    assert results == [0] * calls
    assert tuning.chosen is None and len(tuning.pending) == calls - 3   # the first call of each untimed
    fake_gpu["passed"] = True
    with caplog.at_level(logging.INFO):
        assert int(call(tuning)) == 1
    assert tuning.chosen == "split_k:1024" and not tuning.pending
    assert tuning.times["grouped_mm"] == [3.0] * len(tuning.times["grouped_mm"])
    assert any("take split_k:1024" in record.getMessage() for record in caplog.records)
    decision = rank_products.decisions()["x A^T, 4096 features, 48 wide, < 8 groups"]
    assert decision["chosen"] == "split_k:1024" and decision["median_ms"] == COSTS
    assert decision["host_median_ms"] == pytest.approx(HOST)


def test_a_kernel_that_saves_the_gpu_less_than_it_costs_the_host_loses(fake_gpu):
    fake_gpu["host_costs"]["split_k:1024"] = 2.5   # 1 ms of GPU + 2.5 of host against grouped_mm's 3 + 0.01
    tuning = rank_products._Tuning(list(COSTS))
    for _ in range(3 * (1 + rank_products.TUNING_SAMPLES)):
        call(tuning)
    fake_gpu["passed"] = True
    tuning.read()
    assert tuning.chosen == "split_k:2048"   # 2 + 0.02


def test_the_choice_is_made_at_a_step_s_start_so_a_step_computes_a_shape_one_way(fake_gpu):
    from actors.engine.layout import step_layout
    from tests.helpers.lora_bounds import layout_of

    tuning = rank_products._Tuning(list(COSTS))
    fake_gpu["passed"] = True
    with step_layout(layout_of()):
        results = [int(call(tuning)) for _ in range(3 * (2 + rank_products.TUNING_SAMPLES))]
    assert tuning.chosen is None and results == [0] * len(results)   # samples enough, but the step went on
    with step_layout(layout_of()):   # the next step
        assert int(call(tuning)) == 1 and int(call(tuning)) == 1
    assert tuning.chosen == "split_k:1024"


def test_no_choice_before_every_candidate_has_its_samples(fake_gpu):
    tuning = rank_products._Tuning(list(COSTS))
    fake_gpu["passed"] = True
    for _ in range(3 * rank_products.TUNING_SAMPLES):   # 3 untimed + 3 x (samples - 1) timed calls so far
        call(tuning)
    tuning.read()
    assert tuning.chosen is None
    for _ in range(3):
        call(tuning)
    tuning.read()
    assert tuning.chosen == "split_k:1024"


def test_a_candidate_that_fails_is_left_out_with_a_warning_and_the_call_answered(fake_gpu, caplog):
    tuning = rank_products._Tuning(["grouped_mm", "broken"])
    with caplog.at_level(logging.WARNING):
        call(tuning)                           # grouped_mm's untimed first call
        result = call(tuning)                  # "broken": fails, answered by grouped_mm instead
    assert fake_gpu["ran"][-1] == "grouped_mm" and int(result) == 0
    assert tuning.candidates == ["grouped_mm"] and tuning.chosen == "grouped_mm"
    assert any("broken failed" in record.getMessage() and "shared memory" in record.getMessage()
               for record in caplog.records)


def test_a_grouped_mm_failure_is_not_swallowed(fake_gpu, monkeypatch):
    def failing(name, *args):
        raise RuntimeError("grouped_mm broke")

    monkeypatch.setattr(rank_products, "_run", failing)
    with pytest.raises(RuntimeError, match="grouped_mm broke"):
        call(rank_products._Tuning(["grouped_mm", "split_k:1024"]))


def test_auto_on_a_cpu_is_grouped_mm_and_split_k_needs_a_kernel_that_runs(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(40, 32).to(torch.bfloat16)
    a_stack = torch.randn(2, 8, 32).to(torch.bfloat16)
    offsets = torch.tensor([16, 40], dtype=torch.int32)
    expected = torch.cat([x[:16].float() @ a_stack[0].float().t(), x[16:].float() @ a_stack[1].float().t()])
    for way in ("auto", "split_k"):   # split_k: no Triton runs on this CPU outside the interpreter
        monkeypatch.setattr(rank_products, "WAY", way)
        got = rank_products.down(x, a_stack, offsets)
        assert torch.allclose(got.float(), expected, rtol=2 ** -7, atol=1e-3)
    assert len(calls) == 2


def test_too_wide_a_product_or_no_triton_has_grouped_mm_alone(monkeypatch):
    assert rank_products._candidates(torch.device("cpu"), rank_products.MAX_WIDTH + 8) == ["grouped_mm"]
    monkeypatch.setattr(rank_products, "triton_runs", lambda device: False)   # a CUDA torch without Triton
    monkeypatch.setattr(rank_products.CHECK, "agrees", lambda device: pytest.fail("checked a kernel that cannot run"))
    assert rank_products._candidates(torch.device("cuda"), 48) == ["grouped_mm"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_under_triton_s_interpreter():
    run_interpreted("tests/unit/engine/test_rank_products_interpreted.py", timeout=600)


def test_a_shape_s_choice_is_what_its_later_calls_run(monkeypatch):
    """Once chosen, a call goes straight to the kernel (grouped_mm, or split_k at the chosen part size)."""
    monkeypatch.setattr(rank_products, "_TUNINGS", {})
    ran = []
    monkeypatch.setattr(rank_products, "split_k", lambda left, w, offs, transposed, size: ran.append(("split_k", size))
                        or torch.zeros(left.shape[0], w.shape[1]))
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: ran.append(("grouped_mm",)) or real(*a, **k))
    x, a_stack = torch.randn(40, 32).to(torch.bfloat16), torch.randn(2, 8, 32).to(torch.bfloat16)
    offsets = torch.tensor([16, 40], dtype=torch.int32)
    key = (True, 32, 8, 2, torch.bfloat16, None)
    for chosen, expected in (("split_k:2048", ("split_k", 2048)), ("grouped_mm", ("grouped_mm",))):
        tuning = rank_products._Tuning(["grouped_mm", "split_k:1024", "split_k:2048"])
        tuning.choose(chosen)
        rank_products._TUNINGS[key] = tuning
        rank_products._product(x, a_stack, offsets, True)
        assert ran[-1] == expected
