"""bench/tinker_clients.py runs end to end on a tiny base (its servers and its lone aspen job as processes of
their own, one, then two real `tinker` SDK clients on each server): its JSON has the figures the benchmark reports, each
server trained exactly the tokens its clients sent, and the time-sliced server ran one model per pass. No
speed is asserted here: the figures are the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

REPO = Path(__file__).resolve().parents[2]
STEPS, WARMUP, BATCH = 2, 1, 2


@pytest.mark.long   # 67 s on CI's machine of 2026-12-04: the Tinker bench end to end on a tiny base
def test_the_bench_runs_on_a_tiny_base_and_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(REPO / "bench" / "tinker_clients.py"), "--base", "tiny", "--clients", "1,2",
               "--steps", str(STEPS), "--warmup", str(WARMUP), "--batch", str(BATCH), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "N=2: fused / time-sliced" in done.stdout and "1 client fused / lone job" in done.stdout
    found = json.loads(out.read_text())
    run = found["results"]["2"]
    for mode in ("fused", "time-sliced"):
        figures = run[mode]
        assert figures["tokens_per_s"] > 0 and figures["seconds"] > 0, mode
        assert len(figures["clients"]) == 2, mode
        for client in figures["clients"]:
            assert client["steps"] == STEPS and 0 < client["p50_s"] <= client["p95_s"], (mode, client)
            assert math.isfinite(client["first_loss"]) and math.isfinite(client["last_loss"]), (mode, client)
        assert figures["server_tokens"] == figures["sent_tokens"] > figures["tokens"], mode
        assert figures["tokens"] == sum(client["tokens"] for client in figures["clients"]), mode
    assert run["time-sliced"]["models_per_pass"] == 1
    assert run["time-sliced"]["passes"] == 2 * (STEPS + WARMUP)   # one per client step
    assert [c["tokens"] for c in run["fused"]["clients"]] == [c["tokens"] for c in run["time-sliced"]["clients"]]
    assert run["ratio"] == pytest.approx(run["fused"]["tokens_per_s"] / run["time-sliced"]["tokens_per_s"])
    lone = found["lone"]
    assert lone["steps"] == STEPS and lone["sequences_per_step"] == BATCH and lone["tokens_per_s"] > 0
    assert found["one_client_over_lone"] == pytest.approx(found["results"]["1"]["fused"]["tokens_per_s"]
                                                          / lone["tokens_per_s"])
    assert found["arithmetic_ceiling_tokens_per_s"] > 0


def test_the_custom_loss_bench_runs_on_a_tiny_base(tmp_path):
    """bench/tinker_custom_loss.py: the server side takes one pass a step, the SDK's client-side way two, and both
    sides' losses agree at every step (its exit status says so too)."""
    out = tmp_path / "bench.json"
    command = [sys.executable, str(REPO / "bench" / "tinker_custom_loss.py"), "--base", "tiny", "--steps", "2",
               "--rounds", "2", "--batch", "2", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["losses_agree"] and len(found["losses"]["server"]) == 4
    assert found["server"]["passes_per_step"] == 1.0 and found["client"]["passes_per_step"] == 2.0
    assert found["client_over_server"] == pytest.approx(found["client"]["median_step_s"]
                                                        / found["server"]["median_step_s"])
