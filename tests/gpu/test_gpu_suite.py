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
    # another base model is another run: not mixed into this report
    assert gpu_suite.main([*base, "--parts", "tests", "--base-model", "tiny-llama"]) == 2
