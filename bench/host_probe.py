#!/usr/bin/env python
"""What the host of this machine pays to issue one operation, by kind, measured without a profiler (issue 47): the
figures that let the cost model price a host-bound step on the machine it will run on.

Why: on smollm2's shape the fused step is host-bound (the GPU busy ~10% of it), so its time is the host's work:
the operations the step issues times what each costs on that machine. The cost model's host costs were read off
profiler traces (the profiler's own overhead folded into one scale), one set per lease machine, and the two H200
leases of 2026-12-04 differed ~1.5-2x per operation; the launching operations of a step did not cost alike either
(`_grouped_mm`'s dispatch and a Triton launch each cost more than an `addmm_`). This times each kind of operation the
fused step issues, on tiny tensors so that the device never holds the host back, in bursts shorter than CUDA's launch
queue, the median of `--rounds` bursts:

- the launching operations a fused step issues most (`torch._grouped_mm` with offsets, `addmm_`, `mm`, `zeros`, `cat`,
  `_to_copy`, `copy_`, `mul`, `mul_`, `add`), each as the step's Python calls it, and a Triton kernel's launch (on
  CUDA, where Triton compiles);
- an operation launching nothing (views: `view`, `t`, a slice);
- an autograd node: the same `mul` with and without an input needing a gradient;
- a launch from the backward (autograd's engine, no Python): a backward over a chain of `mul`s, per node;
- a Python function call (a small method reading two attributes), the unit the model counts Python by;
- a synchronisation with nothing queued (CUDA only).

`bench/gpu_cost_model.py --host-probe FILE` prices a step with them (calibration.host_from_probe): each launching
operation at its own kind's cost (any other at the median kind's), scale 1 (no profiler to take out). The lease runs
it first (`bench/gpu_suite.py`'s `host` part, a few seconds), so every lease says what its machine's host costs.
On a CPU it times the CPU's own dispatch (each operation then also computes its tiny result): a check of the code,
and this machine's figures, not a GPU machine's.

    PYTHONPATH=. python bench/host_probe.py [--device cuda] [--json FILE] [--burst 400] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BURST = 400    # operations a burst: under CUDA's launch queue (1,024 entries), so the host never waits on it
ROUNDS = 7
DIM = 64       # tiny tensors: the device's time for each operation stays below the host's


def time_burst(operation: Callable[[], object], burst: int, rounds: int, device: torch.device) -> dict:
    """Seconds of the host per call of `operation` (the median over `rounds` bursts of `burst` calls, the device
    drained before each burst), and the burst's time until the device has run it too (`with_device_s`: above the
    host's where the device, not the host, held the burst back)."""
    def drain() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(min(burst, 50)):   # warm-up: caching allocator, kernel loading, Triton's compile
        operation()
    drain()
    host, full = [], []
    for _ in range(rounds):
        drain()
        started = time.perf_counter()
        for _ in range(burst):
            operation()
        issued = time.perf_counter()
        drain()
        ended = time.perf_counter()
        host.append((issued - started) / burst)
        full.append((ended - started) / burst)
    return {"s": statistics.median(host), "with_device_s": statistics.median(full),
            "spread": (max(host) - min(host)) / statistics.median(host) if statistics.median(host) else 0.0}


def _triton_launch(device: torch.device) -> Callable[[], object] | None:
    """A one-program Triton kernel's launch (adds one to a vector of 64), None where Triton does not compile here."""
    if device.type != "cuda":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _add_one(pointer, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(pointer + offsets, tl.load(pointer + offsets, mask=mask) + 1.0, mask=mask)

    vector = torch.zeros(DIM, device=device)
    return lambda: _add_one[(1,)](vector, DIM, BLOCK=DIM)


def launching_operations(device: torch.device) -> dict[str, Callable[[], object]]:
    """The launching operations a fused step issues most (bench/gpu_cost/predict.py's `kernel_operations`), each
    called as the step calls it, on tiny tensors. Keys: the operation names the cost model's recorder gives."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(DIM, DIM, device=device, dtype=dtype)
    w = torch.randn(DIM, DIM, device=device, dtype=dtype)
    out = torch.zeros(DIM, DIM, device=device, dtype=dtype)
    stacked = torch.randn(4, DIM, 16, device=device, dtype=dtype)
    offsets = torch.tensor([16, 32, 48, 64], device=device, dtype=torch.int32)
    pieces = [torch.randn(16, DIM, device=device, dtype=dtype) for _ in range(4)]
    wide = torch.randn(DIM, DIM, device=device, dtype=torch.float32)
    operations: dict[str, Callable[[], object]] = {
        "_grouped_mm": lambda: torch._grouped_mm(x, stacked, offs=offsets),
        "addmm_": lambda: out.addmm_(x, w),
        "mm": lambda: torch.mm(x, w),
        "zeros": lambda: torch.zeros(DIM, DIM, device=device, dtype=dtype),
        "cat": lambda: torch.cat(pieces),
        "_to_copy": lambda: x.to(torch.float32),
        "copy_": lambda: wide.copy_(x),
        "mul": lambda: x * 0.5,
        "mul_": lambda: out.mul_(0.5),
        "add": lambda: x + w,
    }
    triton_launch = _triton_launch(device)
    if triton_launch is not None:
        operations["triton"] = triton_launch
    return operations


class _Small:
    """A Python function of the size the fused step's host code calls by the thousand (a method reading two
    attributes and returning a tuple)."""

    def __init__(self) -> None:
        self.first, self.second = 1, 2

    def pair(self) -> tuple[int, int]:
        return self.first, self.second


def probe(device: torch.device, burst: int = BURST, rounds: int = ROUNDS) -> dict:
    """Every figure of the module docstring, in seconds; see `host_from_probe` for how the model reads them."""
    timed = {name: time_burst(operation, burst, rounds, device)
             for name, operation in launching_operations(device).items()}
    x = torch.randn(DIM, DIM, device=device)
    views = {"view": lambda: x.view(-1), "t": lambda: x.t(), "slice": lambda: x[1:]}
    view_times = {name: time_burst(operation, burst, rounds, device) for name, operation in views.items()}
    needs = torch.randn(DIM, DIM, device=device, requires_grad=True)
    with_node = time_burst(lambda: needs * 0.5, burst, rounds, device)
    without = time_burst(lambda: x * 0.5, burst, rounds, device)
    backward = _backward_per_node(device, burst, rounds)
    small = _Small()
    python = time_burst(small.pair, 20 * burst, rounds, torch.device("cpu"))   # nothing queued: a plain timing
    result: dict = {
        "machine": platform.node(), "processor": platform.processor() or platform.machine(),
        "python_version": platform.python_version(), "torch": torch.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "burst": burst, "rounds": rounds,
        "kernels": timed,
        "views": view_times,
        "node": {"with_node_s": with_node["s"], "without_s": without["s"],
                 "s": max(with_node["s"] - without["s"], 0.0)},
        "backward_per_node": backward,
        "python": python,
    }
    if device.type == "cuda":
        result["sync"] = time_burst(lambda: torch.cuda.synchronize(device), burst // 4, rounds, device)
    kinds = sorted(value["s"] for value in timed.values())
    result["summary"] = {
        "kernel_median_s": statistics.median(kinds),
        "view_median_s": statistics.median(value["s"] for value in view_times.values()),
        "device_bound": sorted(name for name, value in timed.items() if value["with_device_s"] > 1.5 * value["s"]),
    }
    return result


def _backward_per_node(device: torch.device, burst: int, rounds: int) -> dict:
    """Seconds per node of a backward over a chain of `burst` `mul`s (autograd's engine launching each node's
    kernel, no Python between): the host side of a backward's operations."""
    leaf = torch.randn(DIM, DIM, device=device, requires_grad=True)
    seconds = []
    for _ in range(rounds + 1):
        value = leaf
        for _ in range(burst):
            value = value * 0.999
        total = value.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        total.backward()
        seconds.append((time.perf_counter() - started) / (burst + 1))
        leaf.grad = None
    seconds = seconds[1:]   # the first warms the engine's threads up
    return {"s": statistics.median(seconds), "spread": (max(seconds) - min(seconds)) / statistics.median(seconds)}


def render(result: dict) -> str:
    lines = [f"host probe: {result['machine']} ({result['processor']}), Python {result['python_version']}, "
             f"torch {result['torch']}, {result['device']}{' ' + result['gpu'] if result['gpu'] else ''}",
             f"  {'operation':<24} {'host us':>9} {'with device us':>15}"]
    for name, value in sorted(result["kernels"].items(), key=lambda item: -item[1]["s"]):
        lines.append(f"  {name:<24} {value['s'] * 1e6:9.2f} {value['with_device_s'] * 1e6:15.2f}")
    for name, value in result["views"].items():
        lines.append(f"  view: {name:<18} {value['s'] * 1e6:9.2f}")
    lines.append(f"  autograd node (mul with a gradient - without) {result['node']['s'] * 1e6:.2f} us")
    lines.append(f"  backward, per node (engine, no Python)        {result['backward_per_node']['s'] * 1e6:.2f} us")
    lines.append(f"  Python function call                          {result['python']['s'] * 1e6:.3f} us")
    if "sync" in result:
        lines.append(f"  synchronisation, nothing queued               {result['sync']['s'] * 1e6:.2f} us")
    if result["summary"]["device_bound"]:
        lines.append("  held back by the device (their host figures stand; the device's time was longer): "
                     + ", ".join(result["summary"]["device_bound"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--burst", type=int, default=BURST, help="operations a timed burst (under 1,024 on CUDA)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="bursts timed; the median is kept")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device visible to torch {torch.__version__}; "
                     "--device cpu times this CPU's dispatch")
    if not 1 <= args.burst <= 1000 or args.rounds < 1:
        parser.error("--burst: 1..1000 (under CUDA's launch queue); --rounds: at least 1")
    result = probe(device, args.burst, args.rounds)
    print(render(result), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
