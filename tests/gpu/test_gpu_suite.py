"""The GPU suite's own mechanics, on any machine, with short commands in place of its benchmarks: a part
past its time limit is recorded as timed out and the processes it started are killed with it, and parts run
in separate invocations into one folder add up to one report (JSON and Markdown) naming the device, torch
and CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

# loaded from its file: bench/ on sys.path would shadow modules for the rest of the session
_spec = importlib.util.spec_from_file_location("gpu_suite",
                                               Path(__file__).resolve().parents[2] / "bench" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_suite)

# a command that starts a child which writes its pid and sleeps, then sleeps itself
SPAWNS = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(60)']); "
          "open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child of an exited parent is reaped by init; a zombie counts as gone
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def test_parts_add_up_to_one_report_and_a_slow_part_is_killed_whole(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    plan = {"tests": [[sys.executable, "-c", "print('tests ran')"]],
            "fusion": [[sys.executable, "-c", "print('first')"], [sys.executable, "-c", SPAWNS, str(pid_file)]],
            "memory": [[sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]]}
    monkeypatch.setattr(gpu_suite, "commands", lambda args, out: plan)
    out = tmp_path / "report"
    base = ["--allow-cpu", "--quick", "--out", str(out)]
    assert gpu_suite.main([*base, "--parts", "tests"]) == 0
    started = time.monotonic()
    assert gpu_suite.main([*base, "--parts", "fusion,memory", "--part-timeout", "3"]) == 1
    assert time.monotonic() - started < 20
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not _alive(child), "the timed-out part's child process outlived it"
    report = json.loads((out / "report.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == ["tests", "fusion", "memory"]
    assert parts["tests"]["status"] == "passed" and "tests ran" in parts["tests"]["output_tail"]
    assert parts["fusion"]["status"] == "timed out" and parts["fusion"]["exit_codes"] == [0, None]
    assert parts["memory"]["status"] == "failed" and parts["memory"]["exit_codes"] == [3]
    environment = report["environment"]
    assert environment["torch"] == gpu_suite.torch.__version__ and "cuda" in environment
    assert environment["device"].startswith("cuda:0" if gpu_suite.torch.cuda.is_available() else "cpu")
    markdown = (out / "report.md").read_text()
    assert f"torch {environment['torch']}" in markdown and "CUDA" in markdown and environment["device"] in markdown
    assert "| fusion | timed out |" in markdown
    # a part with no time left of --total-timeout is recorded as not run; the others' results stay
    assert gpu_suite.main([*base, "--parts", "fusion,tests", "--part-timeout", "2", "--total-timeout", "1.5"]) == 1
    parts = {p["part"]: p for p in json.loads((out / "report.json").read_text())["parts"]}
    assert parts["fusion"]["status"] == "timed out" and parts["tests"]["status"] == "not run"
    assert parts["memory"]["status"] == "failed"
    # a part whose limit does not fit the time left waits for the later parts whose limits do, then gets the rest
    assert gpu_suite.main([*base, "--parts", "memory:600,tests:5", "--total-timeout", "60"]) == 1
    report = json.loads((out / "report.json").read_text())
    ran = [p["part"] for p in report["parts"]][-2:]
    parts = {p["part"]: p for p in report["parts"]}
    assert ran == ["tests", "memory"] and parts["tests"]["status"] == "passed"
    assert parts["memory"]["deferred"] and parts["memory"]["status"] == "failed"
    assert parts["memory"]["timeout_s"] < 60 and "deferred" not in parts["tests"]
    # another base model is another run: not mixed into this report
    assert gpu_suite.main([*base, "--parts", "tests", "--base-model", "tiny-llama"]) == 2


@pytest.mark.long
def test_the_lease_script_runs_its_parts_under_one_deadline_and_assembles_the_report(tmp_path):
    """bench/gpu_lease.sh on stub parts, in a copy of the scripts (no carried folders): a part past its limit is
    killed with its child, a failing part recorded, a part whose limit does not fit the time left run after the
    later part that fits and cut at the deadline, and report.md, report.json, log.txt and raw.tar.gz land in $OUT."""
    import shutil
    import subprocess
    import tarfile

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("gpu_lease.sh", "gpu_suite.py", "random_weights.py"):
        shutil.copy(Path(gpu_suite.__file__).with_name(name), repo / "bench" / name)
    pid_file = tmp_path / "child.pid"
    plan = {"tests": [[sys.executable, "-c", "print('tests ran')"]],
            "mfu": [[sys.executable, "-c", SPAWNS, str(pid_file)]],
            "fusion8b": [[sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]],
            "memory": [[sys.executable, "-c", "import time; time.sleep(120)"]],
            "pipeline": [[sys.executable, "-c", "print('pipeline ran')"]]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "LEASE_SUITE_ARGS": f"--plan {tmp_path / 'plan.json'} --limit-scale 1"}
    started = time.monotonic()
    # the budget holds the script's own start (imports of torch, transformers, Ray: 15 s or more on a loaded CI
    # machine, which at 45 s left pipeline's 10 s no room) besides the parts' few seconds
    budget = 75
    done = subprocess.run(["bash", str(repo / "bench" / "gpu_lease.sh"), "--allow-cpu", "--budget", str(budget),
                           "--parts", "tests:10,mfu:3,fusion8b:10,memory:200,pipeline:10"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=budget + 60)
    assert time.monotonic() - started < budget + 15, done.stdout[-2000:]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "raw.tar.gz", "report.json", "report.md"]
    parts = {p["part"]: p for p in json.loads((out / "report.json").read_text())["parts"]}
    assert parts["tests"]["status"] == "passed" and "tests ran" in parts["tests"]["output_tail"]
    assert parts["mfu"]["status"] == "timed out" and parts["fusion8b"]["status"] == "failed"
    # memory's 200 s did not fit what was left: pipeline's 10 ran first, then memory, cut at the deadline
    assert parts["pipeline"]["status"] == "passed" and "pipeline ran" in parts["pipeline"]["output_tail"]
    assert list(parts)[-2:] == ["pipeline", "memory"] and parts["memory"]["deferred"]
    assert parts["memory"]["status"] == "timed out" and parts["memory"]["seconds"] < budget
    time.sleep(0.2)
    assert not _alive(int(pid_file.read_text())), "the timed-out part's child process outlived it"
    with tarfile.open(out / "raw.tar.gz") as raw:
        names = {Path(n).name for n in raw.getnames()}
    assert {"tests.log", "mfu.log", "fusion8b.log", "report.json"} <= names
    assert "| mfu | timed out |" in (out / "report.md").read_text()
    assert "tests ran" in (out / "log.txt").read_text() or "[gpu-suite] tests: passed" in (out / "log.txt").read_text()


def _bench_module(name: str, monkeypatch):
    """bench/<name>.py loaded from its file, under its own name in sys.modules for this test only (so that the
    bench modules it imports by name resolve, without bench/ on sys.path for the rest of the session)."""
    spec = importlib.util.spec_from_file_location(name, Path(gpu_suite.__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_the_prediction_shown_is_the_one_for_the_card_the_lease_landed_on(tmp_path, monkeypatch):
    """The lease may land on an H100 or an H200 (bench/gpu_lease_prepare.sh predicts both): the suite hands
    lora_mfu the prediction of the card the GPU's name says, and the report names the card a prediction is for,
    saying so where it is not the card measured (a guide, not a check of the model)."""
    default, h100 = tmp_path / "prediction.json", tmp_path / "prediction-h100.json"
    default.write_text(json.dumps({"card": "h200", "shape": "llama-3.1-8b", "predicted_step_s": 0.19}))
    h100.write_text(json.dumps({"card": "h100", "shape": "llama-3.1-8b", "predicted_step_s": 0.23}))
    assert gpu_suite.card_prediction(default, "NVIDIA H100 80GB HBM3") == h100
    assert gpu_suite.card_prediction(default, "NVIDIA H200") == default
    assert gpu_suite.card_prediction(default, None) == default          # a dry run on a CPU
    assert gpu_suite.card_prediction(tmp_path / "none.json", "NVIDIA H200") is None
    h100.unlink()
    assert gpu_suite.card_prediction(default, "NVIDIA H100 80GB HBM3") == default   # the H200's, labelled below

    # the mfu part's command carries the chosen file
    h100.write_text(json.dumps({"card": "h100"}))
    monkeypatch.setattr(gpu_suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite.torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    args = gpu_suite.argparse.Namespace(quick=True, base_model="tiny-llama", prediction=default)
    mfu = gpu_suite.commands(args, tmp_path)["mfu"][0]
    assert mfu[mfu.index("--prediction") + 1] == str(h100)

    _bench_module("lora_bench", monkeypatch)
    report = _bench_module("lora_report", monkeypatch)
    aspen = {"status": "passed", "tokens_per_s": 14_000.0, "median_step_s": 0.21, "p10_step_s": 0.2,
             "p90_step_s": 0.3, "lora_mfu": 0.42, "flops_per_s": 4e14}
    result = {"sides": {"aspen": aspen}}
    prediction = {"card": "h200", "shape": "llama-3.1-8b", "predicted_step_s": 0.19,
                  "predicted_tokens_per_s": 16_000.0, "predicted_lora_mfu": 0.5}
    on_h200 = "\n".join(report.shape_lines("llama-3.1-8b", result, prediction, "NVIDIA H200"))
    on_h100 = "\n".join(report.shape_lines("llama-3.1-8b", result, prediction, "NVIDIA H100 80GB HBM3"))
    assert "(bench/gpu_cost_model.py, --card h200) beside the measurement" in on_h200
    assert "a prediction for the H200, not this NVIDIA H100 80GB HBM3" in on_h100
    assert "predicted 0.19, measured 0.21" in on_h100   # still shown beside, as a guide
    fusion = {"status": "passed", "efficiency": {"1": 1.0, "32": 0.8}, "per_adapters": {}}
    lines = report.fusion_lines(fusion, {"card": "h100", "fusion": {"efficiency": {"1": 1.0, "32": 0.9}}},
                                "NVIDIA H100 80GB HBM3")
    assert any("predicted by the cost model (--card h100): 1: 1.000" in line and "32: 0.900 (measured 0.800" in line
               for line in lines), lines


def test_the_fusion_report_puts_the_model_s_growth_beside_the_profiles(monkeypatch):
    """Where the step grew from 1 to 32 adapters: the profiles' kernels (fusion_side's `profile_growth`) and the
    cost model's operations (--fusion's `operation_seconds` at the same counts), each largest growth first, the
    model's labelled with the card it priced; without the model's figures only the measured line."""
    _bench_module("lora_bench", monkeypatch)
    report = _bench_module("lora_report", monkeypatch)
    monkeypatch.syspath_prepend(str(Path(gpu_suite.__file__).parent))   # gpu_cost, as on the lease (bench/ first)
    measured = {"adapters": [1, 32], "grew_most": [
        {"name": "void cutlass::Kernel2<grouped>", "seconds_per_step": [0.050, 0.110], "grew_s": 0.06},
        {"name": "_adamw_kernel", "seconds_per_step": [0.0005, 0.016], "grew_s": 0.0155}]}
    prediction = {"card": "h100", "fusion": {
        "fusion_efficiency": {"1": 1.0, "32": 0.88},
        "adapters_1": {"operation_seconds": {"_grouped_mm": 0.050, "triton:_adamw_kernel": 0.0005, "mm": 0.16}},
        "adapters_32": {"operation_seconds": {"_grouped_mm": 0.0605, "triton:_adamw_kernel": 0.0148, "mm": 0.16}}}}
    fusion = {"status": "passed", "efficiency": {"1": 1.0, "32": 0.73}, "per_adapters": {},
              "profile_growth": measured}
    lines = report.fusion_lines(fusion, prediction, "NVIDIA H100 80GB HBM3")
    grew = [line for line in lines if "grew most from 1 to 32 adapters" in line]
    assert len(grew) == 2, lines
    assert grew[0].startswith("  measured")
    assert "cutlass::Kernel2<grouped> 50.00 -> 110.00, _adamw_kernel 0.50" in grew[0]
    assert "(--card h100)" in grew[1]
    assert "triton:_adamw_kernel 0.50 -> 14.80, _grouped_mm 50.00 -> 60.50" in grew[1] and "mm 160" not in grew[1]
    lines = report.fusion_lines(fusion, {"card": "h100", "fusion": {"fusion_efficiency": {"1": 1.0}}}, None)
    assert [line for line in lines if "grew most" in line] == [grew[0]]
