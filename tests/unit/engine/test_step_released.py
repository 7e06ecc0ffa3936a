"""A fused step leaves nothing of itself behind: once it ends, the adapted layers' inputs (its activations) and every
tensor that carries its autograd graph are freed by reference counting alone, on the CPU's float32 path, on the CUDA
path (run here on a CPU in bfloat16) and with the layers reading one input computed together. A GPU's memory does not
prompt Python's cycle collector, so what a reference cycle or a long-lived cache keeps of a step stays on the card
step after step: on an H200 (2026-12-04) a cache holding each step's layout, whose tensors kept the layers' inputs
and so their graph, took a fused 8B step from 36 GB to 72 GB over 22 steps and ran the fusion benchmark out of
memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from actors.engine import fused_linear, lora_siblings
from tests.helpers.cuda_path_runs import on_the_cuda_path, one_rank_jobs, run_planned
from tests.helpers.isolation import base_for


@pytest.fixture
def no_cycle_collection():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def _inputs_watched(monkeypatch) -> list[tuple[int, weakref.ref]]:
    """(the step's number, a weak reference) for each adapted layer's input as the layer is called."""
    watched: list[tuple[int, weakref.ref]] = []
    forward = fused_linear.FusedLoraLinear.forward

    def watching(self, x):
        watched.append((_STEP[0], weakref.ref(x)))
        return forward(self, x)

    monkeypatch.setattr(fused_linear.FusedLoraLinear, "forward", watching)
    return watched


_STEP = [0]


@pytest.mark.parametrize("path", ["float32", "cuda-path", "siblings"])
def test_a_step_frees_its_activations_and_graph(monkeypatch, no_cycle_collection, path):
    if path != "float32":
        on_the_cuda_path(monkeypatch, "grouped_mm")
        monkeypatch.setattr(lora_siblings, "SIBLINGS", "on" if path == "siblings" else "off")
    together = []
    real = lora_siblings._SiblingLinears.apply
    monkeypatch.setattr(lora_siblings._SiblingLinears, "apply", lambda *a: together.append(1) or real(*a))
    watched = _inputs_watched(monkeypatch)
    _STEP[0] = 0
    left: list[tuple[int, int, int]] = []
    before = _with_a_graph()   # what earlier tests in this process keep (the fixture collected their garbage)

    def after_step(trainer, jobs):
        alive = [step for step, ref in watched if ref() is not None]
        left.append((_STEP[0], len(alive), _with_a_graph() - before))
        _STEP[0] += 1

    base = base_for("float32" if path == "float32" else "bfloat16")
    _, _, steps = run_planned(base, one_rank_jobs(), between_steps=after_step)
    assert steps >= 3 and watched
    assert bool(together) == (path == "siblings")
    assert all(alive == 0 and graphs <= 0 for _, alive, graphs in left), (
        f"(step, layer inputs alive, tensors with a graph more than before the run) after each step: {left}")


def _with_a_graph() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)
