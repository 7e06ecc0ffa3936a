"""bench/experts_lora.py runs as its docstring says (one timed step a job, each side in its own process) and writes
both sides' tokens, seconds and peak resident sets, and their ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_experts_lora_bench_runs_both_sides_and_writes_their_ratio(tmp_path):
    out = tmp_path / "experts.json"
    done = subprocess.run([sys.executable, "bench/experts_lora.py", "--steps", "1", "--rounds", "1", "--json",
                           str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aspen / PEFT (tokens/s), each round:" in done.stdout
    report = json.loads(out.read_text())
    (sides,) = report["rounds"]
    for side in ("aspen", "peft"):
        # one timed step of each of the 4 jobs, 8 sequences of 32-128 tokens each
        assert 4 * 8 * 32 <= sides[side]["tokens"] <= 4 * 8 * 128 and sides[side]["seconds"] > 0
        assert sides[side]["peak_rss_bytes"] > 0
    assert report["ratio"] == sides["ratio"] == sides["aspen"]["tokens_per_s"] / sides["peft"]["tokens_per_s"]
