"""bench/gpu_cost (the GPU step's cost model): what the recorder counts on the virtual CUDA device, against
hand computations (a matmul's FLOPs and bytes, causal attention's FLOPs from the sequence lengths, an index's
duplicates), which host interactions it takes for synchronisations (a host read and a blocking copy do, a
pinned non-blocking copy does not), the timeline's arithmetic on hand-built operations, and the tiny shape's
whole prediction end to end. No timing assertions: the model's figures are checked against the GPU in
docs/cost_model.md, not here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
# imported with bench/ on sys.path only for the import: bench's scripts must not shadow modules afterwards
sys.path.insert(0, str(BENCH))
try:
    import gpu_cost_model
    from gpu_cost.calibration import card_for, host_for, host_names, load
    from gpu_cost.card import h200, kernel_time
    from gpu_cost.operations import Op
    from gpu_cost.predict import graphed, host_counts, operation_seconds, read_later, summarise
    from gpu_cost.report import growth, host_bound_caveat, ratios
    from gpu_cost.timeline import Host, simulate
    from gpu_cost.workload import FUSION_WARMUP, Session, benchmark_module, preimport, record_fusion, record_jobs
finally:
    sys.path.remove(str(BENCH))

CUDA = torch.device("cuda", 0)


@pytest.fixture
def session():
    # as the command's worker does: the optional libraries that read the device at import (Liger imports
    # bitsandbytes) imported before the virtual device exists, whatever this process imported before
    preimport()
    with Session("NVIDIA H200") as active:
        yield active


def _kernels(ops: list[Op], name: str) -> list[Op]:
    return [op for op in ops if op.kind == "kernel" and op.name == name]


def test_a_matmul_is_counted_exactly(session):
    m, k, n = 96, 160, 48
    a = torch.empty(m, k, device=CUDA, dtype=torch.bfloat16)
    b = torch.empty(k, n, device=CUDA, dtype=torch.bfloat16)
    assert a.is_cuda and a.device == CUDA   # the engine's CUDA branches are taken
    out, ops = session.record(lambda: a @ b)
    assert out.shape == (m, n)
    (mm,) = _kernels(ops, "mm")
    assert mm.flops == 2 * m * n * k
    assert mm.read == (m * k + k * n) * 2          # bf16: 2 bytes an element
    assert mm.written == m * n * 2
    assert mm.gemm == (1, m, n, k)
    assert mm.dtype == "bfloat16" and mm.launches == 1


def test_a_linear_with_bias_reads_its_bias(session):
    x = torch.empty(10, 32, device=CUDA)
    weight, bias = torch.empty(24, 32, device=CUDA), torch.empty(24, device=CUDA)
    _, ops = session.record(lambda: torch.nn.functional.linear(x, weight, bias))
    (addmm,) = _kernels(ops, "addmm")
    assert addmm.flops == 2 * 10 * 24 * 32
    assert addmm.read == (10 * 32 + 24 * 32 + 24) * 4
    assert addmm.written == 10 * 24 * 4


def test_an_in_place_accumulating_product_is_a_matmul(session):
    """`out.addmm_(x, w)` (the CUDA LoRA path accumulates the base product into the jobs' update so) is timed as
    the GEMM it is, reading the output it accumulates into, not by its bytes as an elementwise kernel."""
    m, k, n = 4096, 4096, 4096
    out = torch.empty(m, n, device=CUDA, dtype=torch.bfloat16)
    x, w = torch.empty(m, k, device=CUDA, dtype=torch.bfloat16), torch.empty(n, k, device=CUDA, dtype=torch.bfloat16)
    _, ops = session.record(lambda: out.addmm_(x, w.t()))
    (addmm,) = _kernels(ops, "addmm_")
    assert addmm.flops == 2 * m * n * k and addmm.gemm == (1, m, n, k) and addmm.dtype == "bfloat16"
    assert addmm.read == (m * n + m * k + n * k) * 2
    card = h200()
    assert kernel_time(addmm, card) >= addmm.flops / card.gemm_bf16


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_a_triton_kernel_s_in_place_tensors_are_read_and_written(session):
    """The engine's flat AdamW kernel (actors/engine/flat_adamw.py) names the tensors it updates in place: each is
    counted read and written (4 float32 tensors: 32 bytes an element), the bfloat16 copy it writes once (2)."""
    from actors.engine import flat_adamw

    n = 1000
    flat, grad, m, v = (torch.empty(n, device=CUDA) for _ in range(4))
    cast, factor = torch.empty(n, device=CUDA, dtype=torch.bfloat16), torch.ones((), device=CUDA)
    _, ops = session.record(lambda: flat_adamw._adamw_kernel[(1,)](
        flat, grad, m, v, cast, factor, n, n // 2, *flat_adamw.StepHyper(
            lr_a=0.1, lr_b=0.2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, step=1, targets=1.0).kernel_scalars(),
        2.0, HAS_CAST=True, BLOCK_SIZE=1024))
    (kernel,) = [op for op in ops if op.name == "triton:_adamw_kernel"]
    assert kernel.launches == 1
    assert kernel.read + kernel.written == n * (4 * 4 * 2 + 2) + 4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_engine_s_kernel_checks_pass_on_the_virtual_device(session):
    """Each Triton kernel's once-a-device self-check (actors/engine/triton_support.KernelCheck) agrees on the
    virtual device, so that the model times the kernels and not their torch fallbacks. The stacks' copy writes
    through a table of addresses: the values the recorder keeps of the bytes it may have written (zeros of a fill)
    must be forgotten, not compared as if unwritten."""
    from actors.engine import flat_adamw, lora_grad_kernel, lora_stacks

    for module in (flat_adamw, lora_grad_kernel, lora_stacks):
        assert module._agrees(CUDA), module.__name__
    kept = torch.zeros(4, device=CUDA)
    assert session.device.value(kept) is not None           # a fill's value is known...
    table = torch.tensor([[kept.data_ptr(), kept.data_ptr(), 4]], dtype=torch.int64).to(CUDA)
    session.record(lambda: lora_stacks._copy_slots_kernel[(1, 1)](table, BLOCK_SIZE=lora_stacks.BLOCK))
    assert session.device.value(kept) is None               # ...until a kernel with an address table ran


def test_host_reads_and_blocking_copies_are_syncs_a_pinned_non_blocking_copy_is_not(session):
    def run():
        blocking = torch.arange(4).to(CUDA)                                     # pageable, blocking
        quiet = torch.arange(6).pin_memory().to(CUDA, non_blocking=True)    # pinned, non-blocking
        unpinned = torch.arange(5).to(CUDA, non_blocking=True)              # pageable: still waits
        return blocking.tolist(), quiet, unpinned

    (values, quiet, _), ops = session.record(run)
    assert values == [0, 1, 2, 3]            # a host value copied over is known on the device
    copies = [op for op in ops if op.kind == "h2d"]
    assert [op.read for op in copies] == [4 * 8, 6 * 8, 5 * 8]
    assert [op.sync for op in copies] == [True, False, True]
    assert [op.name for op in ops if op.kind == "sync"] == ["tolist"]
    assert sum(op.sync for op in ops) == 3
    assert quiet.is_cuda


def test_synchronize_and_item_are_syncs(session):
    x = torch.ones(3, device=CUDA)
    _, ops = session.record(lambda: (torch.cuda.synchronize(), float(x.sum())))
    assert [op.name for op in ops if op.sync] == ["torch.cuda.synchronize", "__float__"]


def test_causal_varlen_attention_flops_follow_the_sequence_lengths(session):
    from torch.nn.attention.varlen import varlen_attn

    lengths, heads, kv_heads, dim = [3, 5, 8], 4, 2, 16
    tokens = sum(lengths)
    bounds = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32).to(CUDA)
    query = torch.empty(tokens, heads, dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    key = torch.empty(tokens, kv_heads, dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)

    def run():
        out = varlen_attn(query, key, key, bounds, bounds, max(lengths), max(lengths), window_size=(-1, 0),
                          enable_gqa=True)
        out.sum().backward()

    _, ops = session.record(run)
    forward = sum(2 * length * length * dim * heads for length in lengths)   # QK^T and PV, half each: causal
    (fwd,) = _kernels(ops, "_varlen_attn")
    (bwd,) = _kernels(ops, "_varlen_attn_backward")
    assert fwd.flops == forward
    assert bwd.flops == 2.5 * forward


def test_an_accumulating_index_put_counts_its_duplicates(session):
    source = torch.empty(6, 8, device=CUDA, requires_grad=True)
    index = torch.from_numpy(np.array([1, 1, 1, 4, 1, 0])).to(CUDA)
    _, ops = session.record(lambda: source[index].sum().backward())
    (scatter,) = [op for op in ops if op.detail.get("accumulate")]
    assert scatter.detail["max_duplicates"] == 4          # index 1, four times
    assert scatter.detail["indices"] == 6


def test_the_timeline_waits_at_a_sync_and_is_host_bound_when_the_host_is_slow():
    card = h200().scaled(kernel_floor=0.0, launch_gap=0.0)
    kernel = Op("add", "kernel", launches=1, read=card.hbm * card.vectorised * 1e-3, written=0.0,
                detail={"layout": "vectorised"})                      # 1 ms of HBM traffic
    free = Host(call=0.0, view=0.0, kernel=0.0, launch=0.0, node=0.0, sync=0.0)
    (timing,) = simulate([[kernel, kernel, Op("tolist", "sync", sync=True)]], card, free)
    assert timing.seconds == pytest.approx(2e-3)
    assert timing.wait_seconds == pytest.approx(2e-3)
    slow = Host(call=0.0, view=0.0, kernel=5e-3, launch=0.0, node=0.0, sync=0.0)   # 5 ms to issue each
    (timing,) = simulate([[kernel, kernel, Op("tolist", "sync", sync=True)]], card, slow)
    assert timing.seconds == pytest.approx(2 * 5e-3 + 1e-3)   # the GPU runs the last kernel after it is issued
    assert timing.launches == 2 and timing.syncs == 1


def test_a_skinny_product_moves_its_bytes_at_its_dtype_s_measured_share():
    """A LoRA-shaped product (rank 16): bf16 at the card's bf16_skinny share of HBM (the grouped products of the
    2026-12-04 profile), float32 at fp32_skinny; a calibration from before bf16_skinny was measured falls back to
    the vectorised share; a wide product is timed by its FLOPs, whatever either share."""
    card = h200({"bf16_skinny": 0.25, "fp32_skinny": 0.2}).scaled(kernel_floor=0.0)
    bytes_ = card.hbm * 1e-3   # 1 ms at the whole of HBM's bandwidth

    def product(dtype: str, gemm: tuple[int, int, int, int]) -> Op:
        return Op("_grouped_mm", "kernel", launches=1, read=bytes_, flops=2.0 * gemm[1] * gemm[2] * gemm[3],
                  dtype=dtype, gemm=gemm)

    assert kernel_time(product("bfloat16", (1, 3000, 16, 4096)), card) == pytest.approx(1e-3 / 0.25)
    assert kernel_time(product("float32", (1, 3000, 16, 4096)), card) == pytest.approx(1e-3 / 0.2)
    assert kernel_time(product("bfloat16", (1, 3000, 16, 4096)), h200({"vectorised": 0.9}).scaled(
        kernel_floor=0.0)) == pytest.approx(1e-3 / 0.9)
    wide = product("bfloat16", (1, 8192, 8192, 8192))
    assert kernel_time(wide, card) == pytest.approx(wide.flops / card.gemm_bf16)


def test_read_later_lets_the_host_queue_the_next_step_while_the_gpu_finishes_this_one():
    """Each step: 3 ms of host work with no kernel (packing, the forward's launches), then 3 ms of GPU work
    (the backward), then the read-back. Waiting at it, a step is 3 + 3 ms; read a step later, the host packs the
    next step while the GPU works: 3 ms a step after the first."""
    card = h200().scaled(kernel_floor=0.0, launch_gap=0.0)
    host = Host(python=0.0, call=1e-3, view=0.0, kernel=0.0, launch=0.0, node=0.0, sync=0.0)
    packing = Op("pack", "view", calls=3)
    backward = Op("add", "kernel", launches=1, read=card.hbm * card.vectorised * 3e-3, written=0.0,
                  detail={"layout": "vectorised"})
    steps = [[packing, backward, Op("tolist", "sync", sync=True)] for _ in range(3)]
    waiting = simulate(steps, card, host)
    assert [t.seconds for t in waiting] == pytest.approx([6e-3] * 3)
    later = read_later(steps)
    assert [t.seconds for t in simulate(later, card, host)] == pytest.approx([6e-3, 3e-3, 3e-3])
    assert [len(ops) for ops in later] == [3] * 3 and not any(op.sync for ops in later for op in ops)
    assert all(ops[-1].sync for ops in steps)   # the recorded steps are left as they were


def test_a_steps_host_counts_priced_at_the_host_s_costs_are_its_host_time():
    """What refits a machine's host costs from steps measured whole: a host-bound step's host time is its counts
    (Python functions, torch calls, views, launching operations, further launches, autograd nodes,
    synchronisations) times the host's costs. Counted by hand on hand-built operations, and the timeline's host
    seconds for the step against the counts priced at distinct costs."""
    ops = [Op("custom_a", "kernel", launches=1, python=3, calls=2),
           Op("alias", "view", calls=1),
           Op("triton:kernel", "kernel", launches=1, new_node=True, python=1),
           Op("custom_b", "kernel", launches=3, new_node=True),
           Op("custom_a", "kernel", launches=1),
           Op("tolist", "sync", sync=True, calls=1)]
    counts = host_counts(ops)
    assert {k: v for k, v in counts.items() if k != "kernel_operations"} == {
        "python": 4, "call": 4, "view": 2, "kernel": 4, "launch": 2, "node": 2, "sync": 1}
    assert counts["kernel_operations"] == {"custom_a": 2, "triton": 1, "custom_b": 1}
    host = Host(python=1e-6, call=3e-6, view=7e-6, kernel=11e-6, launch=13e-6, node=17e-6, scale=0.5, sync=19e-6)
    (timing,) = simulate([ops], h200(), host)
    priced = host.scale * sum(getattr(host, name) * counts[name] for name in
                              ("python", "call", "view", "kernel", "launch", "node")) + host.sync * counts["sync"]
    assert timing.host_seconds == pytest.approx(priced)


def test_a_step_replayed_as_a_cuda_graph_costs_the_host_only_what_stays_outside_the_graph():
    """The what-if of `--graphed`: after the warm-up, the host pays for what comes before the step's first launch
    (packing), one replay, the copies of the step's new values, the read-back and what follows it; the operations
    between cost it nothing, the GPU's work is unchanged. Blockers: a host read inside the span, the copies of
    tensors made during the step, and the steps whose kernels and shapes no earlier step launched."""
    def step(extra_read: bool) -> list:
        middle = [Op("item", "sync", sync=True)] if extra_read else []
        return [Op("pack", "host", python=5),
                Op("memcpy_h2d", "h2d", detail={"pinned_non_blocking": True}),
                Op("mm", "kernel", launches=1, python=3, gemm=(1, 64, 64, 64), flops=2 * 64**3, read=16384,
                   written=8192, dtype="bfloat16"),
                *middle,
                Op("triton:_adamw_kernel", "kernel", launches=2, new_node=True, read=4096, written=4096),
                Op("tolist", "sync", sync=True, python=1),
                Op("mul_", "kernel", launches=1, python=2, read=4096, written=4096, dtype="float32")]

    host = Host(python=1e-6, call=3e-6, view=7e-6, kernel=11e-6, launch=13e-6, node=17e-6, scale=1.0, sync=19e-6)
    warm, plain, reading = step(False), step(False), step(True)
    captured, blockers = graphed([warm, plain, reading], warmup=1)
    assert captured[0] == warm
    assert blockers == {"host_reads_inside": 1, "host_copies_inside": 2, "steps": 2,
                        "steps_needing_their_own_capture": 1}   # the third launches what the second did
    timings = simulate(captured, h200(), host)
    before = simulate([warm, plain], h200(), host)[1]
    # outside the graph: pack (5 Python + a view), the replay (a view + a call), the copy (a launch), the
    # read-back (1 Python + a view + the sync), the update after it (2 Python + a kernel)
    outside = (5e-6 + 7e-6) + (7e-6 + 3e-6) + 11e-6 + (1e-6 + 7e-6 + 19e-6) + (2e-6 + 11e-6)
    assert timings[1].host_seconds == pytest.approx(outside)
    assert timings[1].gpu_seconds == pytest.approx(before.gpu_seconds)
    assert before.host_seconds > outside   # the graph dropped the kernels' host cost: (3 + 11) + (11 + 13 + 17) us
    assert before.host_seconds - outside == pytest.approx(3e-6 + 11e-6 + 11e-6 + 13e-6 + 17e-6 - 7e-6 - 3e-6)


def test_compile_graphs_steps_are_replayed_between_their_marks_and_capture_once_per_shape(session, monkeypatch):
    """`--fixed-shapes`: aspen's steps as compile: graphs makes them (run eagerly on the virtual device) with marks
    around what that mode captures; `graphed` replays exactly that part. On the tiny shape: no host read inside, the
    marks in every step, and after the warm-up one capture for all steps (the shapes do not change)."""
    import gpu_cost.workload as workload

    from actors.engine import rank_products, weight_grad_products

    monkeypatch.setattr(workload, "FIXED_SHAPES", True)
    for module in (rank_products, weight_grad_products):   # as the command pins them (no clock to tune on)
        monkeypatch.setattr(module, "WAY", "grouped_mm")
    steps = 6
    recorded = record_jobs(session, benchmark_module(REPO), "tiny", 2, steps=steps, in_order=True)
    assert all([op.detail.get("graph_span") for op in ops if op.name == workload.GRAPH_SPAN] == ["begin", "end"]
               for ops in recorded.steps)
    replayed, blockers = graphed(recorded.steps, warmup=2)
    assert blockers["host_reads_inside"] == 0 and blockers["steps"] == steps - 2
    assert blockers["steps_needing_their_own_capture"] == 1
    for ops, before in zip(replayed[2:], recorded.steps[2:], strict=True):
        begin, end = (i for i, op in enumerate(before) if op.name == workload.GRAPH_SPAN)
        inside = [op for op in ops if op.detail.get("graphed") and op.name not in (workload.GRAPH_SPAN,
                                                                                    "graph replay")]
        assert len(inside) == sum(op.kind != "h2d" for op in before[begin + 1:end])   # exactly the marked part
        assert not any(op.detail.get("graphed") for op in ops[ops.index(next(o for o in ops if o.name ==
                                                                                 "graph replay")) + 1 + len(
            before[begin + 1:end]) + 1:] if op.name != workload.GRAPH_SPAN)   # the update and read-back: the host's


def test_a_host_bound_prediction_says_how_far_the_host_s_costs_missed_measured_host_bound_steps():
    """A side whose median step leaves the GPU idle most of the time is predicted by the host's costs alone: the
    report then gives the committed calibration's host-bound checks, each side's error computed from the measured
    and predicted tokens/s it holds (the 2026-12-04 lease's smollm2 sides); a GPU-bound prediction gets none."""
    calibration = load()
    (check,) = [c for c in calibration["host_bound_checks"] if c["shape"] == "smollm2-135m"]
    measured, predicted = check["measured_tokens_per_s"], check["predicted_tokens_per_s"]
    results = {"current": {"median_step": {"gpu_busy": 0.05}},
               "peers": {"packed-bf16": {"median_step": {"gpu_busy": 0.97}}}}
    lines = host_bound_caveat(results, calibration)
    assert lines[0].startswith("Host-bound (GPU busy < 50% of the median step): aspen.")
    expected = f"(b) {(predicted['packed'] - measured['packed']) / measured['packed']:+.1%}"
    assert expected == "(b) -66.1%" and expected in lines[1] and "f1d6eda" in lines[1]
    results["current"]["median_step"]["gpu_busy"] = 0.9
    assert host_bound_caveat(results, calibration) == []


def test_the_tiny_shape_is_predicted_end_to_end(session, tmp_path):
    bench = benchmark_module(REPO)
    steps = 3
    recorded = record_jobs(session, bench, "tiny", 2, steps=steps)
    vocab = bench.SHAPES["tiny"]["vocab_size"]
    every_token = sum(len(ids) for job in range(2) for batch in bench.job_batches(job, steps, vocab)
                      for ids, _ in batch)
    assert sum(recorded.tokens) == every_token     # each step takes one micro-batch of each job, all of them
    assert all(any(op.kind == "kernel" for op in ops) for ops in recorded.steps)
    summary = summarise(recorded, "h200", load(), timed=range(1, steps), throughput=range(1, steps),
                        profiled=None)
    assert summary["predicted_step_s"] > 0 and summary["predicted_tokens_per_s"] > 0
    assert summary["unknown_values"] == []


def test_fusion_says_which_operations_grew_with_the_adapters_and_the_parts_add_up_to_the_step(session):
    """--fusion's growth by operation (what the lease's fusion8b part compares kernel by kernel): each job's
    flat AdamW is one launch over its own adapter (34 bytes a parameter: master, gradient and both moments read
    and written, the bfloat16 copy written), so 4 adapters take 4 times one adapter's; it is listed among what
    grew, and a step's operations add up to the GPU time the timeline gives it."""
    bench = benchmark_module(REPO)
    fused = record_fusion(session, bench, "tiny", [1, 4])
    config, rank = bench.SHAPES["tiny"], bench.LORA["r"]
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = rank * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inner))   # q o, k v, gate up down
    parameters = per_layer * config["num_hidden_layers"]
    card = card_for("h200", load())
    seconds = {}
    for count, recorded in fused.items():
        timed = recorded.steps[FUSION_WARMUP:]
        updates = [op for op in timed[-1] if op.name == "triton:_adamw_kernel"]
        assert len(updates) == count and all(op.bytes == 34 * parameters + 4 for op in updates)   # + the factor
        seconds[count] = {"operation_seconds": operation_seconds(timed, card)}
        timings = simulate(timed, card, host_for(load()))
        copies = sum(kernel_time(op, card) for ops in timed for op in ops if op.kind in ("h2d", "d2h"))
        total = sum(seconds[count]["operation_seconds"].values())
        assert total == pytest.approx((sum(t.gpu_seconds for t in timings) - copies) / len(timed), rel=1e-9)
    grown = {name: (before, after) for name, before, after in growth(seconds[1], seconds[4], limit=20)}
    before, after = grown["triton:_adamw_kernel"]
    assert after == pytest.approx(4 * before, rel=1e-9)
    assert all(after > before for before, after in grown.values())


def test_equal_is_a_host_read_answered_from_known_values(session):
    """torch.equal has no meta kernel (Liger's loss calls it on its incoming gradient): a comparison, a
    reduction and a host read, answered from the values where the recorder knows them (a host value copied over,
    a fill), else True and named."""
    one = torch.tensor(1.0, device=CUDA)
    seed = torch.ones((), device=CUDA)        # a fill: its value known though no host value was copied
    two = torch.tensor(2.0, device=CUDA)
    unknown = torch.empty((), device=CUDA).exp()
    (same, different, guessed), ops = session.record(
        lambda: (torch.equal(one, seed), torch.equal(one, two), torch.equal(one, unknown)))
    assert (same, different, guessed) == (True, False, True)
    assert [op.name for op in ops if op.sync] == ["equal"] * 3
    assert len(_kernels(ops, "eq")) == 3 and len(_kernels(ops, "all")) == 3
    assert "equal" in session.recorder.unknown_values


# run in a process of its own: side (b) applies Liger's kernels, which patch transformers' Llama classes for the
# whole process (every later test's tiny Llama would take Triton kernels on the CPU); as gpu_cost_model.py runs it
PEER_SCRIPT = """
import json, sys
from pathlib import Path
from gpu_cost.operations import MATMULS
from gpu_cost.peers import record_peer
from gpu_cost.workload import Session, benchmark_module, preimport
preimport()
repo = Path(sys.argv[1])
bench = benchmark_module(repo)
for peer in sys.argv[2].split(","):
    with Session("NVIDIA H200") as session:
        recorded, timed, side = record_peer(session, bench, repo, "tiny", peer, steps=int(sys.argv[3]))
    print("RESULT " + json.dumps({
        "peer": peer, "timed": len(timed), "tokens": sum(recorded.tokens),
        "matmul_parameters": recorded.matmul_parameters,
        "adamw": [sum(op.name == "_fused_adamw_" for op in recorded.steps[i]) for i in timed],
        "flops": sum(op.flops for i in timed for op in recorded.steps[i] if op.name in MATMULS), **side}))
"""
PEERS = ("peft", "packed-float32")
PEER_STEPS = 3


@pytest.fixture(scope="module")
def peer_sides() -> dict[str, dict]:
    """Both PEFT sides recorded in one process (its imports are most of its time), each side's figures."""
    out = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(REPO), ",".join(PEERS), str(PEER_STEPS)],
                         capture_output=True, text=True, cwd=BENCH, env={**os.environ, "PYTHONPATH": f"{BENCH}:{REPO}"},
                         check=False, timeout=600)
    sides = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and len(sides) == len(PEERS), out.stderr[-3000:]
    return {side["peer"]: side for side in sides}


@pytest.mark.parametrize("peer", PEERS)
def test_a_peft_side_is_recorded_step_by_step_over_its_padded_or_packed_tokens(peer_sides, peer):
    """bench/lora_mfu.py's PEFT sides (the checkout's peft_baselines.run_jobs) on the virtual device: one timed
    segment per optimizer step, the jobs' sequences in them, and the GEMMs' FLOPs counted by hand per token the
    step computes: the padded loop's padding included, the packed row's not. Per token: the frozen base's forward
    and input gradient, 4 FLOPs a matmul parameter (the LM head's too); each LoRA module's forward, input and
    weight gradients, 6 r (in + out); less the input gradient the first layer's q, k and v never need (their input
    comes from the frozen embeddings): 2 (their weights) + 2 r (3 x hidden)."""
    bench = benchmark_module(REPO)
    steps, shape, side = PEER_STEPS, bench.SHAPES["tiny"], peer_sides[peer]
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    sequences = [s for job in range(bench.JOBS) for batch in bench.job_batches(job, 2 + steps, vocab)[2:]
                 for s in batch]
    per_job = -(-steps * bench.SEQUENCES_PER_JOB // bench.PEFT_SEQUENCES_PER_STEP)
    assert side["timed"] == bench.JOBS * per_job
    assert side["adamw"] == [1] * side["timed"]
    assert side["tokens"] == sum(len(ids) for ids, _ in sequences) == side["real_tokens"]
    kv = shape["hidden_size"] // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = {"q": (hidden, hidden), "k": (hidden, kv), "v": (hidden, kv), "o": (hidden, hidden),
             "gate": (hidden, shape["intermediate_size"]), "up": (hidden, shape["intermediate_size"]),
             "down": (shape["intermediate_size"], hidden)}
    layers, r = shape["num_hidden_layers"], bench.LORA["r"]
    parameters = layers * sum(i * o for i, o in layer.values()) + hidden * vocab
    assert parameters == side["matmul_parameters"]
    lora = layers * sum(i + o for i, o in layer.values())
    first_qkv = sum(i * o for name, (i, o) in layer.items() if name in ("q", "k", "v"))
    per_token = 4 * parameters + 6 * r * lora - (2 * first_qkv + 2 * r * 3 * hidden)
    computed = side["padded_tokens"] if peer == "peft" else side["real_tokens"]
    assert (side["padded_tokens"] > side["real_tokens"]) == (peer == "peft")
    assert side["flops"] == per_token * computed


def test_aspen_s_ratios_to_the_peft_sides_and_the_ceiling_of_processes_taking_turns_on_one_card():
    """(b) counts its faster adapter dtype; (c)'s ceiling is (a)'s timed tokens over its GPU time alone (the
    untimed set-up segment and the host's share of a step left out)."""
    def side(rate: float, gpu: list[float] | None = None, tokens: list[int] | None = None) -> dict:
        return {"predicted_tokens_per_s": rate, "timed_steps": [1, 2],
                "steps": [{"gpu_seconds": s} for s in (gpu or [0.0, 0.0, 0.0])], "tokens": tokens or [0, 0, 0]}

    results = {"current": {"predicted_tokens_per_s": 6000.0},
               "peers": {"peft": side(2000.0, gpu=[9.0, 0.25, 0.15], tokens=[0, 300, 500]),
                         "packed-bf16": side(4000.0), "packed-float32": side(3000.0)}}
    out = ratios(results)
    assert out["over_peft"] == pytest.approx(3.0)
    assert out["over_best_packed"] == pytest.approx(1.5)
    assert out["concurrent_bound_tokens_per_s"] == pytest.approx(800 / 0.4)
    assert out["over_concurrent_at_least"] == pytest.approx(6000 / 2000)


def test_the_command_writes_its_figures(tmp_path):
    out = tmp_path / "model.json"
    assert gpu_cost_model.main(["--shape", "tiny", "--jobs", "2", "--steps", "3", "--no-calibration",
                                "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("predicted_step_s", "predicted_tokens_per_s", "predicted_lora_mfu"):
        assert result[key] > 0
    assert result["current"]["tokens"] and result["parameters"]["card.hbm"]["source"] == "datasheet"
    assert result["current"]["settings"] == [] and result["current"]["median_step"]["syncs"] == 1
    # the what-if: the same steps with their read-back a step later say so, and wait nowhere
    assert gpu_cost_model.main(["--shape", "tiny", "--jobs", "2", "--steps", "3", "--no-calibration",
                                "--read-later", "--json", str(out)]) == 0
    later = json.loads(out.read_text())["current"]
    assert any("read-back a step later" in setting for setting in later["settings"])
    assert later["median_step"]["syncs"] == 0 and later["tokens"] == result["current"]["tokens"]


def test_each_measurement_is_timed_with_the_host_of_the_machine_it_ran_on(tmp_path, capsys):
    """The host is the machine's: the committed calibration holds each lease machine's costs by name, each measured
    section names its machine, and a name it lacks is refused with the names it has."""
    calibration = load()
    assert set(host_names(calibration)) >= {calibration["measured"]["host"],
                                            calibration["measured_2026_12_04"]["host"]}
    earlier, latest = host_for(calibration, "h200-2026-11-28"), host_for(calibration, "h200-2026-12-04")
    assert host_for(calibration) == latest != earlier
    assert earlier.python == calibration["hosts"]["h200-2026-11-28"]["python"]
    with pytest.raises(ValueError, match="no host costs for machine 'h100-1999'.*h200-2026-12-04, h200-2026-11-28"):
        host_for(calibration, "h100-1999")
    with pytest.raises(SystemExit):
        gpu_cost_model.main(["--shape", "tiny", "--no-calibration", "--host", "h100-1999"])
    assert "--host: no host costs for machine 'h100-1999'" in capsys.readouterr().err


def test_a_refit_on_another_machine_keeps_the_earlier_machine_s_host():
    sys.path.insert(0, str(BENCH))
    try:
        from gpu_cost.profile_fit import keep_earlier_host
    finally:
        sys.path.remove(str(BENCH))
    calibration = {"host": {"python": 1e-6, "scale": 0.7, "_machine": "h200-a"}}
    assert keep_earlier_host(calibration, "h200-a") == calibration["host"]   # the same machine: refined in place
    assert "hosts" not in calibration
    assert keep_earlier_host(calibration, "h200-b") == {}
    assert calibration["hosts"] == {"h200-a": {"python": 1e-6, "scale": 0.7, "_machine": "h200-a"}}
    with pytest.raises(SystemExit, match="no '_machine'"):
        keep_earlier_host({"host": {"python": 1e-6}}, "h200-b")


def test_modules_come_from_the_checkout_under_their_name_there():
    """An older checkout (the calibration's 70c0645) holds actors.engine.data where this one holds actors.data:
    the workload takes the checkout's own, never this repository's through its editable install."""
    from gpu_cost.workload import from_checkout

    assert from_checkout("actors.data", "actors.engine.data").__name__ == "actors.data"
    assert from_checkout("actors.engine.nowhere", "actors.spec.job_spec").__name__ == "actors.spec.job_spec"
    with pytest.raises(ImportError, match="actors.engine.nowhere"):
        from_checkout("actors.engine.nowhere")
