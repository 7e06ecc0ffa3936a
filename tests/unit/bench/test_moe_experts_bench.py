"""bench/moe_experts.py runs as its docstring says (one timed step each way) and writes both modes' seconds and
their ratio; the model is left on aspen's job-by-job experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_moe_experts_bench_prints_and_writes_both_modes(tmp_path):
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, "bench/moe_experts.py", "--steps", "1", "--experts", "8", "--top-k", "2",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job by job / grouped:" in done.stdout
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {"aspen_segments", "grouped_mm"} and all(v > 0 for v in report["seconds"].values())
    assert report["ratio"] == report["seconds"]["aspen_segments"] / report["seconds"]["grouped_mm"]
