"""bench/lora_products.py (the lease's `products` part): on a CPU with tiny layers, every product of a layer group
is computed each way it names and each way agrees with float64 products of the same bfloat16 numbers, segment by
segment; a way that mixes up two jobs' factors is reported outside its bound and fails the run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


REPO = Path(__file__).resolve().parents[3]


def _module():
    saved = list(sys.path)
    try:   # loaded from its file; the paths it puts first for its own imports are taken back after
        spec = importlib.util.spec_from_file_location("lora_products", REPO / "bench" / "lora_products.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lora_products"] = module   # its dataclass looks its module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_every_way_of_every_product_agrees_with_float64_and_is_timed(tmp_path):
    out = tmp_path / "products.json"
    done = subprocess.run([sys.executable, "bench/lora_products.py", "--quick", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["copy_bytes_per_s"] > 0
    ways = {(row["group"], row["jobs"], row["form"], row["way"]) for row in report["rows"]}
    module = _module()
    for group in module.QUICK_GROUPS:
        for jobs in (1, 4, 8):
            for form in module.FORMS:
                assert (group, jobs, form, "grouped") in ways and (group, jobs, form, "segments") in ways
            assert (group, jobs, "x_a", "stacked") in ways and (group, jobs, "g_b", "stacked") in ways
    assert all(0 <= row["error_over_bound"] <= 1 and row["seconds"] > 0 for row in report["rows"])
    assert "a layer's six products" in done.stdout


def test_a_way_that_takes_another_jobs_factors_is_caught():
    module = _module()
    ops = module.operands(module.QUICK_GROUPS["o"], 96, 4, torch.device("cpu"))
    right = module.computation("x_a", "segments", ops)()
    assert module.agrees(right, "x_a", ops) <= 1
    wrong = right.clone()
    first, second = ops.bounds[0], ops.bounds[1]
    wrong[first[0]:first[1]] = ops.x[first[0]:first[1]] @ ops.a[1].t()   # the second job's A on the first's rows
    assert module.agrees(wrong, "x_a", ops) > 100
    grad = module.computation("grad_b", "grouped", ops)()
    assert module.agrees(grad, "grad_b", ops) <= 1 and module.agrees(grad.flip(0), "grad_b", ops) > 100
    assert second[0] == first[1]


def test_the_models_figure_is_for_the_card_it_runs_on(monkeypatch):
    """On an H100 the products are set beside the cost model's H100 figure (its lower HBM bandwidth), elsewhere
    beside its calibrated H200's."""
    module = _module()
    assert module.model_card(torch.device("cpu")) == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert module.model_card(torch.device("cuda")) == "h100"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert module.model_card(torch.device("cuda")) == "h200"
    monkeypatch.syspath_prepend(str(REPO / "bench"))   # the cost model (bench/gpu_cost), as the bench run has it
    ops = module.operands(module.QUICK_GROUPS["gate_up"], 4096, 4, torch.device("cpu"))
    h100, h200 = module.predicted_s("h_b", ops, "h100"), module.predicted_s("h_b", ops, "h200")
    assert h100 > h200 > 0   # a bandwidth-bound product: HBM 3.35 against 4.8 TB/s
