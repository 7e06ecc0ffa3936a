#!/usr/bin/env python
"""The six LoRA products of one adapted layer group in a fused step, each timed every way it could be computed,
on this device, at the 8B shape's layers (issue 47): what decides how the CUDA path should compute them.

The cost model puts `torch._grouped_mm` at ~16% of the 8B step's GPU time (25 of 158 ms, 4 jobs), priced by one
rate fitted to 2026-12-04's profile (a third of HBM bandwidth); the step at 32 adapters ran 1.42x slower than it
predicted. Whether that rate is the kernel's bandwidth, a fixed cost a call, or few tiles on a wide K (no split-K
in a grouped GEMM) is what this measures, per product and number of jobs, against the ways that could replace it:

- `grouped`: `torch._grouped_mm` over the jobs' row segments, as actors/engine/lora_siblings.py and lora_cuda.py
  call it (rows grouped for the forward's and the input gradient's products, the sum over the rows grouped for
  the weight gradients);
- `segments`: one `torch.mm` a job, into its rows (or its gradient) of one output;
- `stacked` (the products with a rank-wide output: x A^T, g B): one dense `torch.mm` against every job's factors
  side by side, then each row's own job's columns taken by one gather (n x the FLOPs, one cuBLAS call);
- `split_k`, `split_k_2048` (the same two, on CUDA): the engine's split-K Triton kernel over the segments
  (actors/engine/rank_products.py, which times it against grouped_mm per shape while a trainer's first steps run and
  takes the faster), the feature sum split into parts of ~1,024 or ~2,048 features (a grouped GEMM's output of one
  tile column leaves most multiprocessors idle);
- `jagged` (the weight gradients' sums, dA and dB, on CUDA): the engine's Triton kernel, one program per job and
  output tile over the job's own rows (actors/engine/weight_grad_products.py, timed against grouped_mm in a trainer's
  first steps likewise): at many jobs each job's sum is short and a grouped GEMM's cost per tile and per group may
  outweigh it.

The layer groups: q/k/v (in 4,096, out 6,144, rank 3 x 16), o (4,096, 4,096, 16), gate/up (4,096, 2 x 14,336,
2 x 16), down (14,336, 4,096, 16); `--tokens` rows in `--jobs` equal segments. Each way's result is checked
against float64 products of the same bfloat16 numbers (a bfloat16 rounding plus a float32 sum of K terms, relative
to the sum of the terms' magnitudes), on any device; times: CUDA events over `--reps` calls, the median of
`--rounds`, beside HBM's measured copy bandwidth (the share each product's least bytes reach) and the cost model's
prediction of it (for an H100 where it runs on one, else the H200). On a CPU (`--quick`: tiny layers) it checks the
ways agree; its times say nothing of a GPU.

    PYTHONPATH=. python bench/lora_products.py [--device cuda] [--tokens 4096] [--jobs 1,4,8,32] [--json FILE]
    PYTHONPATH=. python bench/lora_products.py --quick --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch

RANK = 16
# (name, in features, out features, rank of the group): the 8B shape's adapted layer groups, siblings stacked
GROUPS = {"qkv": (4096, 6144, 3 * RANK), "o": (4096, 4096, RANK), "gate_up": (4096, 2 * 14336, 2 * RANK),
          "down": (14336, 4096, RANK)}
QUICK_GROUPS = {"qkv": (128, 192, 3 * 8), "o": (128, 128, 8), "gate_up": (128, 512, 2 * 8), "down": (256, 128, 8)}
FORMS = ("x_a", "h_b", "g_b", "gh_a", "grad_a", "grad_b")
FORM_NAMES = {"x_a": "forward x A^T (T, r)", "h_b": "forward h B^T (T, out)", "g_b": "backward g B (T, r)",
              "gh_a": "backward dh A (T, in)", "grad_a": "dA = dh^T x (n, r, in)", "grad_b": "dB = g^T h (n, out, r)"}
WAYS = ("grouped", "segments", "stacked", "split_k", "split_k_2048", "jagged")


@dataclass
class Operands:
    """One layer group's tensors for `jobs` equal segments of `tokens` rows (bfloat16, on the device)."""

    x: torch.Tensor        # (T, in)
    g: torch.Tensor        # (T, out): the output's gradient
    hidden: torch.Tensor   # (T, r)
    grad_hidden: torch.Tensor   # (T, r)
    a: torch.Tensor        # (n, r, in)
    b: torch.Tensor        # (n, out, r)
    a_side: torch.Tensor   # (n r, in): every job's A, rows side by side (a step's stack)
    b_side: torch.Tensor   # (out, n r): every job's B, columns side by side
    bounds: list[tuple[int, int]]
    offsets: torch.Tensor  # int32 segment ends
    own: torch.Tensor      # (T, r) int64: each row's own job's columns of an (T, n r) product


def operands(size: tuple[int, int, int], tokens: int, jobs: int, device: torch.device) -> Operands:
    fan_in, fan_out, rank = size
    generator = torch.Generator(device="cpu").manual_seed(jobs * 1000 + fan_out)

    def values(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(device)

    a, b = values(jobs, rank, fan_in, scale=fan_in ** -0.5), values(jobs, fan_out, rank, scale=rank ** -0.5)
    ends = [tokens * (index + 1) // jobs for index in range(jobs)]
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    job_of_row = torch.repeat_interleave(torch.arange(jobs), torch.tensor([e - s for s, e in bounds]))
    own = (job_of_row[:, None] * rank + torch.arange(rank)[None, :]).to(device)
    return Operands(x=values(tokens, fan_in), g=values(tokens, fan_out), hidden=values(tokens, rank),
                    grad_hidden=values(tokens, rank), a=a, b=b, a_side=a.reshape(jobs * rank, fan_in).contiguous(),
                    b_side=b.permute(1, 0, 2).reshape(fan_out, jobs * rank).contiguous(), bounds=bounds,
                    offsets=torch.tensor(ends, dtype=torch.int32, device=device), own=own)


def computation(form: str, way: str, ops: Operands):
    """A callable computing `form` by `way` (None where the way does not apply to the form)."""
    gmm = torch._grouped_mm
    x, g, h, gh, a, b, offs = ops.x, ops.g, ops.hidden, ops.grad_hidden, ops.a, ops.b, ops.offsets
    jobs, rank = a.shape[0], a.shape[1]
    if way == "grouped":
        return {"x_a": lambda: gmm(x, a.mT, offs=offs), "h_b": lambda: gmm(h, b.mT, offs=offs),
                "g_b": lambda: gmm(g, b, offs=offs), "gh_a": lambda: gmm(gh, a, offs=offs),
                "grad_a": lambda: gmm(gh.t(), x, offs=offs), "grad_b": lambda: gmm(g.t(), h, offs=offs)}[form]
    if way == "segments":
        rows_out = {"x_a": (x, lambda k: a[k].t(), rank), "h_b": (h, lambda k: b[k].t(), b.shape[1]),
                    "g_b": (g, lambda k: b[k], rank), "gh_a": (gh, lambda k: a[k], a.shape[2])}
        if form in rows_out:
            left, right, width = rows_out[form]

            def per_rows() -> torch.Tensor:
                out = torch.empty(left.shape[0], width, dtype=left.dtype, device=left.device)
                for k, (s, e) in enumerate(ops.bounds):
                    torch.mm(left[s:e], right(k), out=out[s:e])
                return out
            return per_rows
        first, second, shape = ((gh, x, (jobs, rank, x.shape[1])) if form == "grad_a"
                                else (g, h, (jobs, g.shape[1], rank)))

        def per_sum() -> torch.Tensor:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            for k, (s, e) in enumerate(ops.bounds):
                torch.mm(first[s:e].t(), second[s:e], out=out[k])
            return out
        return per_sum
    if way == "stacked" and form in ("x_a", "g_b"):
        left, side = (x, ops.a_side.t()) if form == "x_a" else (g, ops.b_side)
        return lambda: torch.gather(torch.mm(left, side), 1, ops.own)
    if way == "jagged" and form in ("grad_a", "grad_b") and x.is_cuda:
        from actors.engine import weight_grad_products

        if weight_grad_products.triton is None:
            return None
        first, second = (gh, x) if form == "grad_a" else (g, h)
        return lambda: weight_grad_products.jagged(first, second, offs)
    if way.startswith("split_k") and form in ("x_a", "g_b") and x.is_cuda:
        from actors.engine import rank_products

        if rank_products.triton is None:
            return None
        left, weights = (x, a) if form == "x_a" else (g, b)
        size = 2048 if way == "split_k_2048" else 1024
        return lambda: rank_products.split_k(left, weights, offs, form == "x_a", size)
    return None


def reference(form: str, ops: Operands) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 products segment by segment: the exact result of the bfloat16 numbers, the sum of the terms'
    magnitudes, and the terms in each sum."""
    pairs = {"x_a": (ops.x, lambda k: ops.a[k].t()), "h_b": (ops.hidden, lambda k: ops.b[k].t()),
             "g_b": (ops.g, lambda k: ops.b[k]), "gh_a": (ops.grad_hidden, lambda k: ops.a[k])}
    exact, magnitude = [], []
    if form in pairs:
        left, right = pairs[form]
        for k, (s, e) in enumerate(ops.bounds):
            p, q = left[s:e].double(), right(k).double()
            exact.append(p @ q)
            magnitude.append(p.abs() @ q.abs())
        return torch.cat(exact), torch.cat(magnitude), left.shape[1]
    first, second = (ops.grad_hidden, ops.x) if form == "grad_a" else (ops.g, ops.hidden)
    for s, e in ops.bounds:
        p, q = first[s:e].t().double(), second[s:e].double()
        exact.append(p @ q)
        magnitude.append(p.abs() @ q.abs())
    return torch.stack(exact), torch.stack(magnitude), max(e - s for s, e in ops.bounds)


def agrees(got: torch.Tensor, form: str, ops: Operands) -> float:
    """The largest error over its bound (<= 1: within one bfloat16 rounding of the result plus float32's rounding
    of a sum of `terms` products, relative to the terms' magnitudes)."""
    exact, magnitude, terms = reference(form, ops)
    bound = (2.0 ** -8 + terms * 2.0 ** -24) * magnitude + 1e-30
    return float(((got.double() - exact).abs() / bound).max())


def least_bytes(form: str, ops: Operands) -> int:
    """Bytes a product must move at least: its operands read once, its output written once (bfloat16)."""
    tokens, fan_in = ops.x.shape
    fan_out, rank, jobs = ops.g.shape[1], ops.a.shape[1], ops.a.shape[0]
    elements = {"x_a": tokens * fan_in + jobs * rank * fan_in + tokens * rank,
                "h_b": tokens * rank + jobs * fan_out * rank + tokens * fan_out,
                "g_b": tokens * fan_out + jobs * fan_out * rank + tokens * rank,
                "gh_a": tokens * rank + jobs * rank * fan_in + tokens * fan_in,
                "grad_a": tokens * rank + tokens * fan_in + jobs * rank * fan_in,
                "grad_b": tokens * fan_out + tokens * rank + jobs * fan_out * rank}[form]
    return 2 * elements


def gemm_dims(form: str, ops: Operands) -> tuple[int, int, int, int]:
    """(batch, M, N, K) as the cost model's recorder gives a grouped product (the jagged sum's K: all the rows)."""
    tokens, fan_in = ops.x.shape
    fan_out, rank = ops.g.shape[1], ops.a.shape[1]
    return {"x_a": (1, tokens, rank, fan_in), "h_b": (1, tokens, fan_out, rank), "g_b": (1, tokens, rank, fan_out),
            "gh_a": (1, tokens, fan_in, rank), "grad_a": (1, rank, fan_in, tokens),
            "grad_b": (1, fan_out, rank, tokens)}[form]


def model_card(device: torch.device) -> str:
    """The card the cost model prices the products on: an H100 where this is one, else its calibrated H200."""
    return "h100" if device.type == "cuda" and "h100" in torch.cuda.get_device_name(device).lower() else "h200"


def predicted_s(form: str, ops: Operands, card: str = "h200") -> float | None:
    """The cost model's time for the grouped product on `card` (its calibrated H200's shares; None where it cannot
    load)."""
    try:
        from gpu_cost.calibration import card_for, load
        from gpu_cost.card import kernel_time
        from gpu_cost.operations import Op
    except ImportError:
        return None
    dims = gemm_dims(form, ops)
    total = least_bytes(form, ops)
    output = 2 * (ops.a.shape[0] * dims[1] * dims[2] if form.startswith("grad") else dims[1] * dims[2])
    op = Op(name="_grouped_mm", kind="kernel", launches=1, flops=2.0 * dims[1] * dims[2] * dims[3],
            read=total - output, written=output, dtype="bfloat16", gemm=dims)
    return kernel_time(op, card_for(card, load()))


def timed(call, device: torch.device, reps: int, rounds: int) -> float:
    """Seconds a call: the median over `rounds` of `reps` calls back to back (CUDA events; the host clock on a CPU)."""
    for _ in range(2):
        call()
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            began = time.perf_counter()
            for _ in range(reps):
                call()
            samples.append((time.perf_counter() - began) / reps)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, megabytes: int, reps: int, rounds: int) -> float:
    """HBM's (or memory's) bytes/s measured by a large device copy: bytes read plus written over its time."""
    source = torch.empty(megabytes * 2 ** 19, dtype=torch.bfloat16, device=device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), device, reps, rounds)
    return 2 * source.numel() * source.element_size() / seconds


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    groups = QUICK_GROUPS if args.quick else GROUPS
    bandwidth = copy_bandwidth(device, 16 if args.quick else 1024, args.reps, args.rounds)
    card = model_card(device)
    rows, failures = [], []
    for name, size in groups.items():
        for jobs in args.jobs:
            ops = operands(size, args.tokens, jobs, device)
            for form in FORMS:
                least = least_bytes(form, ops)
                predicted = predicted_s(form, ops, card)
                for way in WAYS:
                    call = computation(form, way, ops)
                    if call is None:
                        continue
                    error = agrees(call(), form, ops)
                    if error > 1.0:
                        failures.append(f"{name} {form} {way} {jobs} jobs: {error:.2f} x its bound")
                    seconds = timed(call, device, args.reps, args.rounds)
                    rows.append({"group": name, "jobs": jobs, "form": form, "way": way, "seconds": seconds,
                                 "least_bytes": least, "share_of_copy": least / seconds / bandwidth,
                                 "error_over_bound": error,
                                 "predicted_s": predicted if way == "grouped" else None})
            del ops
    return {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "torch": torch.__version__, "tokens": args.tokens, "jobs": args.jobs, "groups": groups, "model_card": card,
            "copy_bytes_per_s": bandwidth, "rows": rows, "failures": failures}


def table(result: dict) -> str:
    """Microseconds a product, each way, per group and number of jobs, with the share of the measured copy
    bandwidth its least bytes reach and the cost model's figure for the grouped call (on `model_card`)."""
    by_key = {(r["group"], r["jobs"], r["form"], r["way"]): r for r in result["rows"]}
    lines = [f"{result['device']}, torch {result['torch']}, {result['tokens']} tokens; copy bandwidth "
             f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s; us a call (share of that bandwidth)",
             f"{'group':8} {'jobs':>4}  {'product':26} " + "".join(f"{way:>18}" for way in WAYS)
             + f"{'model ' + result.get('model_card', 'h200'):>10}"]
    for name in result["groups"]:
        for jobs in result["jobs"]:
            for form in FORMS:
                cells = []
                for way in WAYS:
                    row = by_key.get((name, jobs, form, way))
                    cells.append(f"{row['seconds'] * 1e6:9.1f} ({row['share_of_copy']:4.2f})" if row else " " * 18)
                grouped = by_key.get((name, jobs, form, "grouped"))
                model = (f"{grouped['predicted_s'] * 1e6:10.1f}" if grouped and grouped["predicted_s"] is not None
                         else " " * 10)
                lines.append(f"{name:8} {jobs:>4}  {FORM_NAMES[form]:26} " + "".join(f"{c:>18}" for c in cells)
                             + model)
    totals = {}
    for row in result["rows"]:
        key = (row["jobs"], row["way"])
        totals[key] = totals.get(key, 0.0) + row["seconds"]
    lines.append("a layer's six products, all four groups, summed (us): " + "; ".join(
        f"{jobs} jobs " + ", ".join(f"{way} {totals[(jobs, way)] * 1e6:.0f}" for way in ("grouped", "segments")
                                    if (jobs, way) in totals) for jobs in result["jobs"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="rows of the step (4096: fusion's; --quick 96)")
    parser.add_argument("--jobs", type=lambda text: [int(v) for v in text.split(",")], default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny layers: the ways' agreement, on any device")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (96 if args.quick else 4096)
    args.jobs = args.jobs or ([1, 4, 8] if args.quick else [1, 4, 8, 32])
    args.reps = args.reps or (2 if args.quick else 20)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: --device cpu (with --quick) checks the ways agree")
    if any(jobs < 1 or jobs > args.tokens for jobs in args.jobs):
        parser.error(f"--jobs: each between 1 and --tokens ({args.tokens})")
    result = measure(args)
    print(table(result), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if result["failures"]:
        print("ways outside their bound: " + "; ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
