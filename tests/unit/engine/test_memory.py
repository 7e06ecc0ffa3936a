"""The trainer's memory prediction against an independent measurement: the allocation timeline recorded by
torch.profiler during the same step (the peak of live CPU allocations), over a small grid of step sizes, job
counts, LoRA ranks, dropout, dtypes and recomputation. Goal: 3% median and 6% max relative error. And a CPU
trainer's predicted peak resident set against the kernel's count (VmHWM), in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.engine.memory import measure_allocations


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_the_admission_estimate_counts_the_parameters_peft_trains(targets):
    """`policies.adapter_memory` gets plain shapes from `adapted_shapes`; its parameter count is PEFT's for the
    same LoRA config on the same model (16 bytes each: weight, gradient, two AdamW moments)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from actors.engine.lora_targets import adapted_shapes
    from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER, adapter_memory_bytes, adapter_parameters
    from tests.helpers.models import tiny_model

    model = tiny_model("llama")
    output = model.get_output_embeddings()
    linear_shapes = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and m is not output}
    shapes = adapted_shapes(targets, linear_shapes)
    peft_model = get_peft_model(model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter_parameters(4, shapes) == trained
    assert adapter_memory_bytes(4, shapes) == BYTES_PER_ADAPTER_PARAMETER * trained


def test_the_cpu_peak_is_the_allocation_timelines_peak():
    """`measure_allocations` on CPU against allocations whose sizes are known: the peak of live bytes in
    time order, including a transient that an operation allocates and its caller frees (cross-entropy's
    log-softmax), which counting per operation would place before its own allocation."""
    mib = 1 << 20

    def known() -> None:
        a = torch.empty(4 * mib, dtype=torch.uint8)
        b = torch.empty(8 * mib, dtype=torch.uint8)
        del a
        c = torch.empty(2 * mib, dtype=torch.uint8)
        del b, c

    _, peak, left = measure_allocations(known, torch.device("cpu"))
    assert (peak, left) == (12 * mib, 0)

    logits = torch.randn(512, 4096)
    targets = torch.randint(0, 4096, (512,))
    _, peak, _ = measure_allocations(lambda: torch.nn.functional.cross_entropy(logits, targets), torch.device("cpu"))
    assert peak >= logits.numel() * logits.element_size(), peak   # the log-probabilities, as large as the logits


def test_a_block_an_earlier_measurement_allocated_and_this_one_frees_does_not_lower_its_peak():
    """torch's CPU allocator remembers the size of every block allocated while a profiler was on, and reports it
    when the block is freed under a later profiler. Such a free (a measured step's survivors released during the
    next measurement: a trainer's garbage, a batch packed ahead) is no allocation of this window: the peak and
    the bytes left are those of the window's own allocations, as sized here."""
    mib = 1 << 20
    survivors = []
    measure_allocations(lambda: survivors.append(torch.empty(16 * mib, dtype=torch.uint8)), torch.device("cpu"))

    def frees_the_survivor_then_allocates() -> torch.Tensor:
        survivors.clear()
        scratch = torch.empty(3 * mib, dtype=torch.uint8)
        kept = torch.empty(2 * mib, dtype=torch.uint8)
        del scratch
        return kept

    _, peak, left = measure_allocations(frees_the_survivor_then_allocates, torch.device("cpu"))
    assert (peak, left) == (5 * mib, 2 * mib)


def _fresh_process(program: str, variable: str, value: str | None) -> subprocess.CompletedProcess:
    """`program` in a fresh Python process (what torch reads once, at its start), with `variable` set to `value` or
    left out of its environment; it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr[-2000:]
    return run


PROFILED = """
import sys, torch
from actors.engine.memory_profile import MemoryWindow, allocation_peak, with_memory_records
_, records = with_memory_records(lambda: torch.ones(1 << 20).sum())
window = MemoryWindow(torch.device("cpu"))
window.start(0)
kept = torch.ones(1 << 18)
print("PEAKS", allocation_peak(records)[0], window.stop())
"""


@pytest.mark.parametrize("level", [None, "0"])
def test_a_measurement_leaves_the_profilers_lines_out_of_stderr_unless_asked_for(level):
    """Kineto prints two lines a profile ("USDT: ... profiler_start") at its highest level: a run in a
    terminal showed two per measured step. In a fresh process (kineto reads its level once): none by default,
    the measurements still taken; with KINETO_LOG_LEVEL set by the user, kineto's own lines as before."""
    run = _fresh_process(PROFILED, "KINETO_LOG_LEVEL", level)
    peaks = [int(value) for value in run.stdout.split("PEAKS")[1].split()]
    assert peaks[0] >= 4 << 20 and peaks[1] >= 1 << 20, peaks   # the 4 MiB and 1 MiB tensors were seen
    if level is None:
        assert "USDT" not in run.stderr and "profiler_start" not in run.stderr, run.stderr[-2000:]
    else:
        assert run.stderr.count("profiler_start") == 2, run.stderr[-2000:]


FREED_INSIDE = """
import torch
from actors.engine.memory_profile import MemoryWindow, _c10_log_level
earlier = torch.ones(1 << 16)   # allocated before the window, freed inside it
window = MemoryWindow(torch.device("cpu"))
window.start(0)
del earlier
kept = torch.ones(1 << 18)
print("PEAK", window.stop(), "LEVEL", _c10_log_level().value)
"""


@pytest.mark.parametrize("level", [None, "WARNING"])
def test_a_block_freed_inside_a_window_is_not_warned_about_unless_asked_for(level):
    """torch's CPU allocator logs a warning (C++, to stderr) when a block allocated before a profile started is
    freed inside it: every measured window meets one, and `aspen run --in-process` printed it in the user's
    terminal. In a fresh process: none by default, the window's peak still measured and c10's log level back at
    warnings after it; with TORCH_CPP_LOG_LEVEL set by the user, torch's own line as before."""
    run = _fresh_process(FREED_INSIDE, "TORCH_CPP_LOG_LEVEL", level)
    words = run.stdout.split()
    assert int(words[words.index("PEAK") + 1]) >= 1 << 20, run.stdout   # the 1 MiB tensor was seen
    assert words[words.index("LEVEL") + 1] == "1", run.stdout            # warnings on again after the window
    warned = "Memory block of unknown size" in run.stderr
    assert warned == (level is not None), run.stderr[-2000:]


def test_the_weights_are_counted_when_a_step_needs_them_not_at_each_job_added_or_removed(monkeypatch):
    """The step meter's weights (each parameter's storage once, for the CPU's count of a step's peak) are counted
    again after jobs were added or removed, once, when the next step needs them: not at every addition (a walk
    over every module and tensor of a base carrying many jobs' adapters), and equal to a count made afresh."""
    from actors.engine import memory
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.models import random_examples, tiny_model

    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    walks = []
    model_bytes = memory.model_bytes
    monkeypatch.setattr(memory, "model_bytes", lambda model: walks.append(1) or model_bytes(model))
    for index in range(4):
        trainer.add_job(TrainingJob.create(job_spec(f"j{index}", max_steps=2), base,
                                           random_examples(index, vocab=VOCAB), [], seed=index))
    trainer.remove_job("j3")
    assert walks == []
    report = trainer.train_step()
    assert walks == [1] and report.peak_memory_bytes > model_bytes(base.model)
    assert trainer.meter.weights == model_bytes(base.model)
    assert trainer.meter.parameter_ptrs == {p.untyped_storage().data_ptr() for p in base.model.parameters()}
    trainer.train_step()
    assert walks == [1], "the weights were counted again though no job came or went"


def test_jobs_sharing_terms_are_united_once_and_a_later_jobs_width_of_an_input_still_wins():
    """`combined_bytes` unites each distinct terms object's kept inputs once (equal terms are one object), in the
    order of its last job: the same bytes as uniting every job's in job order, also where two kinds of jobs keep
    one input at different widths (a plain LoRA on the CUDA path keeps the input in the base's dtype, a DoRA job in
    float32), interleaved."""
    from actors.engine.adapter_activations import AdapterTerms, combined_bytes

    plain = AdapterTerms(per_token=10, kept_inputs=(("qkv-0", 128), ("mlp-0", 128)), transient=0)
    dora = AdapterTerms(per_token=30, kept_inputs=(("qkv-0", 256),), transient=1000)
    for order in ([plain, dora, plain], [dora, plain, dora], [plain, plain, dora], [dora, dora, plain]):
        jobs = [(terms, 7 + index) for index, terms in enumerate(order)]
        kept: dict[object, int] = {}
        for terms, _ in jobs:   # the reference: every job's kept inputs, in job order
            kept.update(terms.kept_inputs)
        stream = sum(tokens for _, tokens in jobs)
        expected = sum(t.per_token * n for t, n in jobs) + sum(kept.values()) * stream + max(t.transient for t in order)
        assert combined_bytes(jobs) == expected, [t.per_token for t in order]
