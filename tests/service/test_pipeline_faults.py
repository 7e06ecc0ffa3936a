"""Pipeline trainers that run alone (one pipeline per process: stage 0 lives in it): recomputation on stages,
grouped LoRA, stages sharing a device. A stage killed mid-run (the jobs resume from their checkpoints on new
stages and end exactly as on one device): tests/service/test_pipeline_service.py.
The reference and the reasons for exactness: tests/service/test_pipeline_trainer.py. Stages that read only
their own tensors (`StageLoader`) train as one device: tests/service/test_pipeline_service.py, whose trainers
load their stages so."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from actors.engine.pipeline.stage_messages import StageSettings
from actors.service.pipeline.pipeline_processes import LocalPipeline, StageLost
from tests.helpers.pipeline import (
    LAYERS,
    LoaderFailingInStages,
    assert_same_as_single_device,
    loader,
    one_thread_per_process,
    run_and_keep_heads,
    sft,
    single_device,
    tiny_base,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from one_thread_per_process()


def test_recomputation_on_stages_is_exact():
    jobs = [sft("re-a", 30, lora={"dropout": 0.2}), sft("re-b", 31, grad_accum=2)]
    reference = single_device(tiny_base(layers=LAYERS), jobs, recompute="layers")
    with LocalPipeline(loader(layers=LAYERS), 2, split=[3, 2], threads=1,
                       settings=StageSettings(recompute="layers")) as pipeline:
        states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs, reference)


def test_grouped_lora_on_stages_agrees_with_one_device(monkeypatch):
    """Grouped LoRA (one batched product per rank for all of a step's adapters, each job's rows padded to the
    longest) on both sides: equal to 1e-5, not bit for bit, since a pipeline packs fewer jobs per micro-batch
    than one device packs per step, and the batched product's shape changes its float32 sums."""
    from actors.engine import lora_grouped
    jobs = [sft("group-a", 50), sft("group-b", 51, lora={"r": 8, "alpha": 16}), sft("group-c", 52),
            sft("group-d", 53, grad_accum=2)]
    monkeypatch.setattr(lora_grouped, "GROUPING", "grouped")
    weights, _, _ = single_device(tiny_base(layers=LAYERS), jobs)
    with LocalPipeline(loader(layers=LAYERS), 2, split="even", threads=1,
                       settings=StageSettings(lora_grouping="grouped")) as pipeline:
        states, _ = run_and_keep_heads(pipeline, jobs)
    for name, tensors in weights.items():
        for key, value in tensors.items():
            scale = float(value.abs().max())
            assert float((states[name]["tensors"][key] - value).abs().max()) <= 1e-5 * max(scale, 1e-3), (name, key)


def test_stages_sharing_a_device_pass_tensors_through_shared_queues_exactly():
    """transport "shared" (what stages on one GPU use, by CUDA IPC there; shared memory here): the same
    adapters, losses and records as one device."""
    jobs = [sft("shared-a", 70, lora={"dropout": 0.1}), sft("shared-b", 71, grad_accum=2, max_grad_norm=0.05),
            sft("shared-c", 72)]
    reference = single_device(tiny_base(layers=LAYERS), jobs)
    with LocalPipeline(loader(layers=LAYERS), 3, split="even", threads=1, transport="shared") as pipeline:
        states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs, reference)


def test_a_stage_that_fails_while_starting_is_named_at_once_and_nothing_is_left_running():
    """Stage 1 cannot load its base: stage 0 does not wait out the rendezvous timeout (600 s here) but names
    the stage as soon as it ended, and no stage process is left behind."""
    with pytest.raises(StageLost, match=r"stage ended while starting: stage 1 \(aspen-stage-1, exit code 1\)"):
        LocalPipeline(LoaderFailingInStages(), 2, split="even", threads=1, timeout_s=600)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("aspen-stage")]


def test_a_stage_that_does_not_start_in_time_is_named_and_stopped():
    """Stage 1 still loading after the pipeline's timeout: TimeoutError naming it, its process stopped."""
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"pipeline stages \[1\] did not load their layers and meet stage 0 "
                                           r"within 5 s"):
        LocalPipeline(LoaderFailingInStages(hang_s=120), 2, split="even", threads=1, timeout_s=5)
    assert time.monotonic() - started < 60, "the stage's process was not stopped (joined until it ended)"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("aspen-stage")]
