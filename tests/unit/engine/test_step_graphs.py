"""`compile: graphs` (actors/engine/step_graphs.py) on the CPU: a step in its fixed shape
(actors/engine/fixed_shapes.py) against the packed step (the same gradients within the rounding of their sums), a
replayed step against the same step run eagerly in its fixed shape (bit for bit: a replay re-runs the captured
operations without the Python that issued them, tests/helpers/graph_replay.py, so a host number baked into the
capture, or Python state a replay does not restore, would show), and the ways a step is refused a graph or a
capture fails (the step then runs eagerly)."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch

from actors.engine import graphed_steps, lora_cuda, lora_grouped_mm, step_graphs
from actors.engine.fixed_shapes import FixedShape, counts_of, fixed_batch, shape_for, split_parts
from actors.engine.packing import JobMicroBatch, pack
from tests.helpers.fused import VOCAB, first_step_gradients, job_spec
from tests.helpers.graph_replay import ReplayGraphs, WarmOnly
from tests.helpers.models import random_examples, tiny_model


@pytest.fixture(autouse=True)
def _no_earlier_models():
    """The layers' kept stacks (lora_stacks.KEPT, one table for the process) hold the entries of earlier tests' models
    until the collector frees them, which could fall inside a replay here: the stand-in would then see a tensor its
    capture read freed, as a GPU would. A trainer holds one base for its life: no layer it captured dies meanwhile."""
    gc.collect()


@pytest.fixture(autouse=True)
def _cuda_path_on_this_cpu(monkeypatch):
    """The CUDA LoRA path (whose gradients go into the jobs' pooled buffers: what a graph can replay) on the CPU,
    grouped_mm where torch has it here."""
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    if lora_grouped_mm.grouped_mm_works(torch.device("cpu")):
        monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")


def _examples(seed: int, lengths: list[int]):
    from actors.data import Example

    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        prompt = max(1, length // 3)
        out.append(Example(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return out


def test_a_fixed_batch_holds_each_jobs_tokens_bounds_and_targets_in_its_segment():
    a, b = _examples(0, [5, 7]), _examples(1, [9])
    packed = pack([JobMicroBatch("a", a), JobMicroBatch("b", b)])
    assert counts_of(packed) == ([12, 9], [2, 1])
    shape = shape_for(("a", "b"), *counts_of(packed), ((40, 4), (None, 0)))
    assert shape == FixedShape(("a", "b"), (64, 64), (5, 2))   # 4 x 12 tokens, past a's ceiling of 40; 4 rows
    assert shape.holding_counts(*counts_of(pack([JobMicroBatch("a", _examples(4, [30])), JobMicroBatch("b", b)]))
                                ) is shape
    bigger = counts_of(pack([JobMicroBatch("a", _examples(2, [70])), JobMicroBatch("b", b)]))
    assert shape.holding_counts(*bigger).capacity == (128, 64)                    # doubled
    assert shape.holding_counts(*bigger, ((40, 4), (None, 0))).capacity == (80, 64)   # past its ceiling: its bucket
    assert shape_for(("a", "b"), *counts_of(packed), ((None, 0), (None, 0))).capacity == (64, 64)
    assert shape_for(("a",), [100], [1]).capacity == (448,)   # 4 x 100, bucketed
    grown = FixedShape(("a", "b"), (80, 64), (3, 2))
    fixed = fixed_batch(packed, grown, pad_token_id=0)
    parts = fixed.parts()
    assert parts["input_ids"][:5].tolist() == list(a[0].input_ids) and parts["input_ids"][12:80].eq(0).all()
    assert parts["input_ids"][80:89].tolist() == list(b[0].input_ids)
    assert parts["position_ids"][:12].tolist() == list(range(5)) + list(range(7))
    assert parts["position_ids"][12:15].tolist() == [0, 1, 2]          # the padding: a sequence of its own
    # a's sequences, its padding to 80, an empty slot at 80; b's sequence, its padding to 144
    assert parts["cu_seqlens"].tolist() == [0, 5, 12, 80, 89, 144]
    targets = parts["target_job"] < 2
    assert int(targets.sum()) == sum(packed.job_targets) and parts["job_targets"].tolist() == packed.job_targets
    shift = torch.where(packed.target_job == 1, 80 - 12, 0)
    assert torch.equal(torch.nonzero(targets).squeeze(1), packed.target_index + shift)
    assert torch.equal(parts["target_ids"][targets], packed.target_ids)
    assert split_parts(grown, fixed.values).keys() == parts.keys()
    with pytest.raises(ValueError, match="do not fit its fixed segment"):
        fixed_batch(pack([JobMicroBatch("a", _examples(3, [90])), JobMicroBatch("b", b)]), grown, 0)


def _trainer(base, jobs, **options):
    from actors.engine.job import TrainingJob
    from actors.engine.trainer import FusedTrainer

    trainer = FusedTrainer(base, step_tokens=100_000, **options)
    for spec, examples, seed in jobs:
        job = TrainingJob.create(spec, base, examples, [], seed=seed)
        trainer.add_job(job)
        with torch.no_grad():   # B away from its zero start, so that every gradient is exercised
            for name, parameter in job.adapter.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name) + seed))
    return trainer


def _jobs():
    return [(job_spec("a", lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}), random_examples(0, vocab=VOCAB),
             0),
            (job_spec("b", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, batch_size=2),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]


def test_a_step_in_its_fixed_shape_has_the_packed_steps_gradients_within_rounding(monkeypatch):
    """float32: the padding's rows add exact zeros and attend to nothing real, so the only difference is the order
    of the sums (a longer stream, other blocks): within the rounding tolerance of the step's longest chain."""
    from actors.engine.models import from_module
    from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    model = tiny_model("llama", VOCAB)
    packed = first_step_gradients(_trainer(from_module(copy.deepcopy(model), None), _jobs()))
    trainer = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs", graph_backend=WarmOnly())
    fixed = first_step_gradients(trainer)
    assert trainer.graphs.entries, "the step did not run in a fixed shape"
    assert fixed.keys() == packed.keys()
    longest = max(len(e) for _, examples, _ in _jobs() for e in examples)
    terms = llama_chain_terms(model.config, sequence=longest, tokens=trainer.graphs.shapes[("a", "b")].tokens)
    for key, expected in packed.items():
        magnitude = float(expected.abs().max())
        assert magnitude > 0, key
        assert float((fixed[key] - expected).abs().max()) <= rounding_tolerance(terms, magnitude), key


def _losses_and_weights(trainer, steps: int):
    losses = [[result.loss for result in trainer.train_step().results] for _ in range(steps)]
    weights = {(job.name, n): p.detach().clone() for job in trainer.jobs.values()
               for n, p in job.adapter.named_parameters()}
    return losses, weights


@pytest.mark.parametrize("siblings", ["on", "off"])
def test_a_replayed_step_equals_the_same_step_run_eagerly_bit_for_bit(monkeypatch, siblings):
    """bfloat16, two jobs with micro-batches of new lengths every step: the steps after the capture are replays
    (new tokens, bounds and targets copied into the captured inputs; the jobs' gradient views attached around
    them), and every loss and weight equals the eager fixed-shape run's exactly. With the layers reading one input
    computed together (lora_siblings.py, as on CUDA) and apart."""
    from actors.engine import lora_siblings
    from actors.engine.models import from_module

    monkeypatch.setattr(lora_siblings, "SIBLINGS", siblings)

    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    replays = ReplayGraphs()
    graphed = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs", graph_backend=replays)
    got = _losses_and_weights(graphed, 8)
    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    eager = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs", graph_backend=WarmOnly())
    expected = _losses_and_weights(eager, 8)
    assert replays.replayed >= 3, (replays.replayed, graphed.graphs.captures)
    assert got[0] == expected[0]
    assert got[1].keys() == expected[1].keys()
    assert all(torch.equal(got[1][key], expected[1][key]) for key in expected[1])
    start = _losses_and_weights(_trainer(from_module(copy.deepcopy(model), None), _jobs()), 0)[1]
    assert any(not torch.equal(got[1][key], start[key]) for key in start)   # the replays did train


def test_the_stand_in_replays_what_a_graph_would_bake_and_refuses_a_host_read():
    """A Python number read at capture stays in the replay (as in a CUDA graph); a host read inside stops it."""
    backend = ReplayGraphs()
    x, out, scale = torch.ones(3), torch.zeros(3), [2.0]
    graph, _ = backend.capture(lambda: out.copy_(x * scale[0]))
    backend.replay(graph)          # capture ran it already
    x.fill_(3.0)
    scale[0] = 10.0
    backend.replay(graph)
    assert out.tolist() == [6.0, 6.0, 6.0]   # new input values, the captured scale
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        backend.capture(lambda: x.sum().item())


def test_steps_a_graph_cannot_take_run_eagerly_and_say_why(monkeypatch, caplog):
    """A job with LoRA dropout: the step runs eagerly (the reason logged once); a base off a GPU without a stand-in:
    refused at the start, with the fix; a capture that fails leaves the shape eager, the step's numbers the eager
    ones."""
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer

    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    with pytest.raises(ValueError, match="compile: graphs captures steps as CUDA graphs.*set compile: none"):
        FusedTrainer(from_module(copy.deepcopy(model), None), compile="graphs")
    dropping = [(job_spec("d", lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}),
                 random_examples(3, vocab=VOCAB), 3)]
    trainer = _trainer(from_module(copy.deepcopy(model), None), dropping, compile="graphs",
                       graph_backend=ReplayGraphs())
    with caplog.at_level(logging.INFO, logger="actors.engine.graphed_steps"):
        for _ in range(3):
            trainer.train_step()
    assert not trainer.graphs.entries
    assert [r.message for r in caplog.records].count("compile: graphs: a step runs eagerly: job 'd' has LoRA "
                                                     "dropout (its masks are drawn on the host's generator)") == 1

    class Failing(ReplayGraphs):
        def capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    failing = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs", graph_backend=Failing())
    with caplog.at_level(logging.WARNING, logger="actors.engine.step_graphs"):
        got = _losses_and_weights(failing, 4)
    assert any("could not be captured as a graph; its shape stays eager" in r.message for r in caplog.records)
    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    expected = _losses_and_weights(_trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs",
                                            graph_backend=WarmOnly()), 4)
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][key], expected[1][key]) for key in expected[1])


def test_a_jobs_file_or_trainer_asking_graphs_with_what_they_cannot_take_is_refused_with_the_fix():
    from pydantic import ValidationError

    from actors.service.scheduler.config import TrainerConfig

    with pytest.raises(ValidationError, match="compile: graphs with layout: padded is not offered.*set layout: packed"):
        TrainerConfig(compile="graphs", layout="padded")
    with pytest.raises(ValidationError, match="compile: graphs with recompute: layers is not offered"):
        TrainerConfig(compile="graphs", recompute="layers")
    assert TrainerConfig(compile="graphs").compile == "graphs"


def test_the_memory_plan_counts_a_graphed_steps_fixed_shape():
    """`step_cost` and `job_step_tokens` (what the trainer's step budget and memory model count) are the fixed
    shape's a graphed step takes, padding included; a step a graph cannot take costs its packed tokens."""
    from actors.engine.models import from_module

    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    trainer = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs",
                       graph_backend=WarmOnly())
    micro = [JobMicroBatch(job.name, job.peek()) for job in trainer.jobs.values()]
    planned = trainer.step_cost(micro)
    trainer.train_step()
    shape = trainer.graphs.shapes[("a", "b")]
    assert planned == shape.tokens and trainer.job_step_tokens(micro) == list(shape.capacity)
    assert shape.tokens >= 2 * sum(mb.num_tokens for mb in micro)   # room to grow: ROOM x the first batches
    eager = _trainer(from_module(copy.deepcopy(model), None), _jobs())
    assert eager.step_cost(micro) == sum(mb.num_tokens for mb in micro)


def _move_gradient_buffer(trainer, name: str) -> None:
    """Job `name`'s gradient buffer made anew (same values, another address), as a release and a new buffer would."""
    from actors.engine.lora_masters import pool_of

    grads = pool_of(trainer.jobs[name].optimizer.parameters).grads
    grads.values = grads.values.clone()
    grads._views.clear()
    grads._all_views = None
    for parameter in grads.parameters:
        parameter.grad = None


def _run_with_changes(trainer, steps: int) -> list:
    """Steps in which job `a` leaves after its 4th optimizer step (its max_steps) and job `b`'s buffer moves."""
    losses = []
    for step in range(steps):
        if step == 2:
            _move_gradient_buffer(trainer, "b")
        report = trainer.train_step()
        if report is None:
            break
        losses.append({result.job: result.loss for result in report.results})
        for name in [name for name, job in trainer.jobs.items() if job.done]:
            trainer.remove_job(name)
    return losses


def test_a_new_job_set_or_a_moved_buffer_is_captured_again_never_replayed_stale(monkeypatch):
    """A replay reads and writes the addresses its capture did: when job a leaves (the step's job set changes) a new
    shape is captured, and when job b's gradient buffer is made anew (its address checked before each replay) its
    graph is captured again (3 captures; 2 without the check); every loss equals the same run's eagerly."""
    from actors.engine.models import from_module

    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    jobs = [(job_spec("a", max_steps=4, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", max_steps=12, batch_size=2, lora={"r": 8, "alpha": 16, "target_modules": ["q_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    replays = ReplayGraphs()
    graphed = _trainer(from_module(copy.deepcopy(model), None), jobs, compile="graphs", graph_backend=replays)
    got = _run_with_changes(graphed, 12)
    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    expected = _run_with_changes(_trainer(from_module(copy.deepcopy(model), None), jobs, compile="graphs",
                                          graph_backend=WarmOnly()), 12)
    assert got == expected
    assert {tuple(losses) for losses in got} == {("a", "b"), ("b",)}
    assert graphed.graphs.captures >= 3 and replays.replayed >= 4, (graphed.graphs.captures, replays.replayed)


def test_the_next_steps_batch_made_during_this_one_gives_the_same_steps(monkeypatch):
    """As on CUDA (`batches.ahead`), the next step's fixed batch is made on the host while this step's kernels run
    and taken by the step of those very micro-batches: the steps equal the ones packed when they come."""
    from actors.engine.models import from_module

    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    taken = []
    original = step_graphs.StepGraphs.take_ahead

    def counting(self, key):
        batch = original(self, key)
        taken.append(batch is not None)
        return batch

    monkeypatch.setattr(step_graphs.StepGraphs, "take_ahead", counting)
    ahead = _trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs", graph_backend=ReplayGraphs())
    ahead.batches.ahead = True
    got = _losses_and_weights(ahead, 6)
    assert taken[1:] == [True] * 5   # every step after the first was made during the one before
    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    expected = _losses_and_weights(_trainer(from_module(copy.deepcopy(model), None), _jobs(), compile="graphs",
                                            graph_backend=WarmOnly()), 6)
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][key], expected[1][key]) for key in expected[1])


def _optimizer_steps_as_on_cuda(monkeypatch) -> None:
    """The jobs' optimizer steps as the trainer takes them on CUDA (`step_jobs(on_device=True)`: the one-pass AdamW,
    which writes each job's compute-dtype copy with its masters), on this CPU."""
    from actors.engine import joint_steps
    from actors.engine import trainer as trainer_module

    def on_device(optimizers, targets, *, on_device=False, later=None):
        return joint_steps.step_jobs(optimizers, targets, on_device=True, later=later)

    monkeypatch.setattr(trainer_module, "step_jobs", on_device)


@pytest.mark.parametrize(("accumulation", "warmup"), [((3, 3), 4), ((2, 3), 5)])
def test_a_capture_after_a_step_that_only_accumulated_refreshes_the_adapters_at_every_replay(
        monkeypatch, accumulation, warmup):
    """Jobs accumulating gradients over micro-batches, their optimizer steps as on CUDA (the one-pass AdamW writes
    each job's compute-dtype copy; the kept stacks refreshed from it at the next step): the step captured follows a
    step that only accumulated, so every copy was current and an eager step would skip the refreshes; the graph still
    holds them, and every loss and weight equals the eager run's (without `lora_masters.every_refresh` the replays
    read the stacks of the capture's weights)."""
    from actors.engine.models import from_module

    _optimizer_steps_as_on_cuda(monkeypatch)
    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    jobs = [(job_spec("a", grad_accum=accumulation[0], lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", grad_accum=accumulation[1], batch_size=2,
                      lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]   # ranks of 8s: the layers' stacks are kept
    monkeypatch.setattr(step_graphs, "WARMUP", warmup)
    replays = ReplayGraphs()
    got = _losses_and_weights(_trainer(from_module(copy.deepcopy(model), None), jobs, compile="graphs",
                                       graph_backend=replays), 10)
    monkeypatch.setattr(step_graphs, "WARMUP", 10**9)
    expected = _losses_and_weights(_trainer(from_module(copy.deepcopy(model), None), jobs, compile="graphs",
                                            graph_backend=WarmOnly()), 10)
    assert replays.replayed >= 3, replays.replayed
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][key], expected[1][key]) for key in expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replays_of_jobs_of_every_optimizer_and_adapter_setting_equal_their_eager_steps(monkeypatch, dtype):
    """The same check (tests/helpers/graph_check.py) over what else a job sets that a graph replays or the eager
    updates around it change: LoRA+ (two learning rates), rank-stabilised scaling, gradient clipping, weight decay,
    accumulation; ranks not of one multiple of 8 (stacks padded and made each step, not kept); adapters on the MLP
    only beside ones on attention (other sibling groups); in bfloat16 and float32."""
    from actors.engine.models import from_module
    from tests.helpers.graph_check import CheckedGraphs

    _optimizer_steps_as_on_cuda(monkeypatch)
    monkeypatch.setattr(graphed_steps, "StepGraphs", CheckedGraphs)
    monkeypatch.setattr(step_graphs, "WARMUP", 2)
    jobs = [(job_spec("a", grad_accum=2, max_grad_norm=0.5, weight_decay=0.1,
                      lora={"r": 8, "alpha": 16, "use_rslora": True, "loraplus_lr_ratio": 16,
                            "target_modules": "all-linear"}), random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", batch_size=2, max_grad_norm=0.01,
                      lora={"r": 12, "alpha": 8, "target_modules": ["gate_proj", "up_proj", "k_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1),
            (job_spec("c", lora={"r": 4, "alpha": 8, "target_modules": ["down_proj"]}),
             random_examples(2, vocab=VOCAB, max_len=30), 2)]
    trainer = _trainer(from_module(tiny_model("llama", VOCAB).to(dtype), None), jobs, compile="graphs",
                       graph_backend=ReplayGraphs())
    _losses_and_weights(trainer, 8)
    checks = trainer.graphs.checks
    assert len(checks) >= 4 and not trainer.graphs.refusals, (len(checks), trainer.graphs.refusals)
    assert all(check.largest_loss_difference() == 0.0 for check in checks)
    assert all(check.largest_gradient_difference() == 0.0 for check in checks)


def test_every_replay_equals_the_eager_step_from_the_same_state(monkeypatch):
    """The check the GPU test makes of real CUDA graphs (tests/helpers/graph_check.py), here on the stand-in: each
    replay, then the same step eagerly from the gradients it started from, at the jobs' real learning rate, one job
    accumulating over two micro-batches and one over three, the optimizer's flow as on CUDA. On the CPU the two are
    equal bit for bit (so the check itself adds nothing of its own); without `lora_masters.every_refresh` they are
    not."""
    from actors.engine.models import from_module
    from tests.helpers.graph_check import CheckedGraphs

    _optimizer_steps_as_on_cuda(monkeypatch)
    monkeypatch.setattr(graphed_steps, "StepGraphs", CheckedGraphs)
    monkeypatch.setattr(step_graphs, "WARMUP", 5)   # the capture at step 6: after a step no job's optimizer took
    jobs = [(job_spec("a", grad_accum=2, lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", grad_accum=3, batch_size=2, lora={"r": 16, "alpha": 32, "target_modules": ["q_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]
    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    trainer = _trainer(from_module(model, None), jobs, compile="graphs", graph_backend=ReplayGraphs())
    _losses_and_weights(trainer, 12)
    checks = trainer.graphs.checks
    assert len(checks) >= 5, len(checks)
    assert all(check.largest_loss_difference() == 0.0 for check in checks)
    assert all(check.largest_gradient_difference() == 0.0 for check in checks)
    assert all(float(eager.abs().max()) > 0 for check in checks for _, eager in check.gradients)


def test_a_replayed_steps_peak_teaches_nothing_and_the_graphs_memory_is_held_beside_other_steps(monkeypatch):
    """A replay runs in its graph's memory pool, which the allocator does not count as the step's: its report says
    it was replayed and not measured (the eager steps of its shape were). The graphs' pools are held beside every
    step but the one that replays in its own (`graph_held_bytes`, which the memory plan adds: on CUDA a capture's
    reserved memory; set by hand here, where the stand-in holds none)."""
    from actors.engine.models import from_module

    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    model = tiny_model("llama", VOCAB).to(torch.bfloat16)
    trainer = _trainer(from_module(model, None), _jobs(), compile="graphs", graph_backend=ReplayGraphs())
    reports = [trainer.run_step(trainer.compose(), measure=True) for _ in range(4)]
    # eager; captured then replayed (a capture only records the step); replays
    assert [report.replayed for report in reports] == [False, True, True, True]
    assert [report.memory_measured for report in reports] == [True, False, False, False]
    assert reports[2].as_row()["replayed"] is True
    (entry,) = trainer.graphs.entries.values()
    entry.held = 3 << 30
    own = [JobMicroBatch(job.name, job.peek()) for job in trainer.jobs.values()]
    assert trainer.graph_held_bytes(own) == 0                 # it replays in that pool
    alone = [JobMicroBatch("b", trainer.jobs["b"].peek())]    # another job set: another shape, beside the pool
    assert trainer.graph_held_bytes(alone) == 3 << 30


def test_an_evaluation_between_steps_is_captured_around_once_and_never_replayed_on_freed_stacks(monkeypatch):
    """An evaluation (or a generation: "try it") runs another grouping of adapters through the layers, whose stacks
    the layers keep beside the step's (lora_stacks.GROUPINGS): the first evaluation keeps new stacks, so the step
    after it is captured again (the kept stacks' refresh it captured is not theirs); a later evaluation finds its
    stacks kept, and the steps go on replaying. Every replay equals its eager step, and none reads a freed tensor."""
    from actors.engine import lora_stacks
    from actors.engine.models import from_module
    from tests.helpers.graph_check import CheckedGraphs

    monkeypatch.setattr(graphed_steps, "StepGraphs", CheckedGraphs)
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    jobs = [(job_spec("a", lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", batch_size=2, lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]
    trainer = _trainer(from_module(tiny_model("llama", VOCAB).to(torch.bfloat16), None), jobs, compile="graphs",
                       graph_backend=ReplayGraphs())
    _losses_and_weights(trainer, 4)
    assert trainer.graphs.captures == 1
    version = lora_stacks.KEPT.version
    trainer.evaluate(trainer.jobs["a"], random_examples(5, count=4, vocab=VOCAB), batch_size=2)
    assert lora_stacks.KEPT.version != version   # the layers' stacks were replaced by the evaluation's grouping
    replays = trainer.graphs.replays
    _losses_and_weights(trainer, 4)
    assert trainer.graphs.captures == 2 and trainer.graphs.replays > replays
    version, replays = lora_stacks.KEPT.version, trainer.graphs.replays
    trainer.evaluate(trainer.jobs["a"], random_examples(6, count=4, vocab=VOCAB), batch_size=2)
    _losses_and_weights(trainer, 3)
    assert lora_stacks.KEPT.version == version and trainer.graphs.captures == 2
    assert trainer.graphs.replays == replays + 3
    checks = trainer.graphs.checks
    assert len(checks) >= 4 and all(check.largest_loss_difference() == 0.0 for check in checks)
    assert all(check.largest_gradient_difference() == 0.0 for check in checks)


def test_a_saved_adapter_tried_between_steps_leaves_no_replay_on_what_it_changed(monkeypatch):
    """"Try it" with a finished job's saved adapter (actors/service/trainer/try_adapter.py) wraps layers the running
    jobs do not adapt, generates through them and unwraps them: the model's layers changed, so the next step is
    captured again; every replay equals its eager step, and none reads a tensor freed since its capture."""
    from actors.engine.adapter_surgery import add_adapter, remove_adapter
    from actors.engine.generate import greedy_generate_many
    from actors.engine.models import from_module
    from actors.spec.lora_config import LoraConfig
    from tests.helpers.graph_check import CheckedGraphs

    monkeypatch.setattr(graphed_steps, "StepGraphs", CheckedGraphs)
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    jobs = [(job_spec("a", lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
             random_examples(0, vocab=VOCAB), 0),
            (job_spec("b", batch_size=2, lora={"r": 16, "alpha": 32, "target_modules": ["q_proj"]}),
             random_examples(1, vocab=VOCAB, max_len=40), 1)]
    base = from_module(tiny_model("llama", VOCAB).to(torch.bfloat16), None)
    trainer = _trainer(base, jobs, compile="graphs", graph_backend=ReplayGraphs())
    _losses_and_weights(trainer, 3)
    handle = add_adapter(base.model, "done@try", LoraConfig(r=8, alpha=16, target_modules="all-linear"), seed=3)
    for parameter in handle.parameters():
        parameter.requires_grad_(False)
    greedy_generate_many(base, [("done@try", [5, 6, 7]), (None, [5, 6, 7])], 4, set())
    remove_adapter(base.model, "done@try")
    _losses_and_weights(trainer, 5)
    assert trainer.graphs.captures == 2, trainer.graphs.captures
    checks = trainer.graphs.checks
    assert len(checks) >= 4 and all(check.largest_loss_difference() == 0.0 for check in checks)
    assert all(check.largest_gradient_difference() == 0.0 for check in checks)


def test_a_shape_measured_only_by_an_earlier_step_does_not_hold_captures_back_but_the_steps_own_do(monkeypatch):
    """The LoRA products' kernels are chosen by measuring each shape over its first calls (kernel_tuning.py; CUDA
    only, so stood in for here). A shape only the trainer's warm-up or the memory probe called is never called again,
    so never chosen: it must not keep the jobs' steps from their capture. A shape the step itself still measures
    must (a capture would time its candidates inside the graph): once chosen, the next step is captured."""
    from actors.engine import kernel_tuning
    from actors.engine.models import from_module

    monkeypatch.setattr(kernel_tuning, "TUNINGS", {})
    leftover = kernel_tuning.TUNINGS[("warm-up's shape",)] = kernel_tuning.Tuning("a warm-up's shape",
                                                                                ["grouped_mm", "split_k:1024"])
    # candidates enough that the test's calls are each a candidate's first, untimed one (no CUDA events)
    own = kernel_tuning.TUNINGS[("the step's shape",)] = kernel_tuning.Tuning("the step's shape",
                                                                            [f"kernel {i}" for i in range(8)])
    monkeypatch.setattr(step_graphs, "WARMUP", 1)
    trainer = _trainer(from_module(tiny_model("llama", VOCAB).to(torch.bfloat16), None), _jobs(), compile="graphs",
                       graph_backend=ReplayGraphs())
    forward = trainer.graphs.forward

    def measuring(layout, input_ids, position_ids):   # the step calls its own shape, as rank_products does
        kernel_tuning.measured(own, lambda name: input_ids)
        return forward(layout, input_ids, position_ids)

    trainer.graphs.forward = measuring
    _losses_and_weights(trainer, 3)
    assert trainer.graphs.captures == 0 and not kernel_tuning.settled()
    own.chosen = "grouped_mm"   # its samples read: the next step's check finds it chosen
    _losses_and_weights(trainer, 2)
    assert trainer.graphs.captures == 1 and leftover.chosen is None
