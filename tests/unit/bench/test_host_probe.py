"""bench/host_probe.py (what a machine's host pays to issue each kind of operation) and the cost model's host priced
by it (calibration.host_from_probe, `bench/gpu_cost_model.py --host-probe`): the burst timing against a fake clock
whose every tick is known, the probe's figures on this CPU (each there, positive; no timing asserted), and a step of
hand-built operations priced by a probed host against the sum worked out by hand from the probe's numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))
try:
    import gpu_cost_model
    import host_probe
    from gpu_cost.calibration import host_for, load, with_probe
    from gpu_cost.card import h200
    from gpu_cost.operations import Op
    from gpu_cost.timeline import simulate
finally:
    sys.path.remove(str(BENCH))


def test_a_burst_is_timed_per_call_by_the_median_of_its_rounds(monkeypatch):
    """A fake clock: each call of the operation takes `cost` of its round (rounds of 2, 5 and 3 us a call), the
    drain before and after a burst none; the host's seconds a call are the median round's, exactly."""
    clock = {"now": 0.0}
    costs = iter([1.0] * 10 + [2e-6] * 10 + [5e-6] * 10 + [3e-6] * 10)   # a warm-up of one burst, then 3 rounds

    def operation():
        clock["now"] += next(costs)

    monkeypatch.setattr(host_probe.time, "perf_counter", lambda: clock["now"])
    timed = host_probe.time_burst(operation, burst=10, rounds=3, device=torch.device("cpu"))
    assert timed["s"] == pytest.approx(3e-6) and timed["with_device_s"] == pytest.approx(3e-6)
    assert timed["spread"] == pytest.approx((5e-6 - 2e-6) / 3e-6)


def test_the_probe_times_every_kind_of_operation_on_this_cpu(tmp_path, capsys):
    arguments = ["--device", "cpu", "--burst", "20", "--rounds", "2", "--json", str(tmp_path / "p.json")]
    assert host_probe.main(arguments) == 0
    probe = json.loads((tmp_path / "p.json").read_text())
    assert set(probe["kernels"]) == {"_grouped_mm", "addmm_", "mm", "zeros", "cat", "_to_copy", "copy_", "mul",
                                     "mul_", "add"}   # no Triton launch on a CPU
    figures = [value["s"] for value in (*probe["kernels"].values(), *probe["views"].values())]
    assert all(seconds > 0 for seconds in figures)
    assert probe["python"]["s"] > 0 and probe["backward_per_node"]["s"] > 0 and probe["node"]["s"] >= 0
    assert "sync" not in probe and probe["gpu"] is None and probe["device"] == "cpu"
    assert "_grouped_mm" in capsys.readouterr().out


def test_a_probed_host_prices_each_kind_of_operation_at_its_own_cost():
    """Each launching operation the probe timed at its own figure (any Triton kernel at "triton"'s), another at the
    median of the probed kinds, a view at the views' median, a node and Python functions at theirs; scale 1; a
    further launch of one operation at the calibration's default host's cost (the probe does not time it)."""
    probe = {"machine": "lease-box", "device": "cuda:0",
             "kernels": {"_grouped_mm": {"s": 30e-6}, "addmm_": {"s": 8e-6}, "triton": {"s": 20e-6}},
             "summary": {"kernel_median_s": 10e-6, "view_median_s": 2e-6},
             "node": {"s": 3e-6}, "python": {"s": 0.1e-6}, "sync": {"s": 15e-6}}
    calibration, machine = with_probe(load(), probe)
    assert machine == "probe:lease-box" and machine not in load().get("hosts", {})
    host = host_for(calibration, machine)
    default = host_for(load())
    assert host.scale == 1.0 and host.launch == default.launch and host.sync == 15e-6
    ops = [Op("_grouped_mm", "kernel", launches=1, python=4),
           Op("triton:_add_groups_kernel", "kernel", launches=2, new_node=True),
           Op("cat", "kernel", launches=1, python=2),
           Op("view", "view", python=1),
           Op("tolist", "sync", sync=True)]
    (timing,) = simulate([ops], h200(), host)
    by_hand = (30e-6 + 0.4e-6) + (20e-6 + default.launch + 3e-6) + (10e-6 + 0.2e-6) + (2e-6 + 0.1e-6) + (2e-6 + 15e-6)
    assert timing.host_seconds == pytest.approx(by_hand)   # the sync op: a view's cost, then the sync's


def test_the_cost_model_refuses_a_file_that_is_no_host_probe_and_two_hosts(tmp_path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"kernels": {}}))
    with pytest.raises(SystemExit):
        gpu_cost_model.main(["--host-probe", str(wrong), "--no-calibration"])
    error = capsys.readouterr().err
    assert f"--host-probe {wrong}: not a host probe's JSON" in error and "bench/host_probe.py --json FILE" in error
    with pytest.raises(SystemExit):
        gpu_cost_model.main(["--host-probe", str(wrong), "--host", "h200-2026-11-28"])
    assert "one host, either a calibrated machine or a probed one" in capsys.readouterr().err


def test_the_probe_refuses_a_burst_past_the_launch_queue_and_cuda_where_there_is_none(capsys):
    with pytest.raises(SystemExit):
        host_probe.main(["--device", "cpu", "--burst", "2000"])
    assert "--burst: 1..1000 (under CUDA's launch queue)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            host_probe.main(["--device", "cuda"])
        error = capsys.readouterr().err
        assert "no CUDA device visible" in error and "--device cpu times this CPU's dispatch" in error
