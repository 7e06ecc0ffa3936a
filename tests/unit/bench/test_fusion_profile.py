"""bench/fusion_side.py with --profile (the lease's fusion8b part): two steps at the fewest and at the most adapters
under torch.profiler, and where the step's time grew between them (`profile_growth`, bench/profile_step.growth):
the operators whose time a step grew most, with each end's seconds, and the step's totals at both ends."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))   # only while these modules import: bench/ holds names like memory, pipeline
try:
    import fusion_side
    import profile_step
finally:
    sys.path.remove(str(BENCH))


def test_growth_lists_what_grew_most_first_with_both_ends():
    fewer = {"seconds_per_step_by_name": {"gemm": 0.100, "norm": 0.010, "gone": 0.004}, "kernel_s_per_step": 0.114,
             "launches_per_step": 900.0}
    more = {"seconds_per_step_by_name": {"gemm": 0.101, "norm": 0.030, "grouped": 0.050}, "kernel_s_per_step": 0.181,
            "launches_per_step": 950.0}
    grown = profile_step.growth(fewer, more, top=3)
    assert [row["name"] for row in grown["grew_most"]] == ["grouped", "norm", "gemm"]
    assert grown["grew_most"][0] == {"name": "grouped", "seconds_per_step": [0.0, 0.050], "grew_s": 0.05}
    assert grown["grew_most"][1]["grew_s"] == pytest.approx(0.020)
    assert grown["totals"]["kernel_s_per_step"] == [0.114, 0.181]
    assert grown["totals"]["launches_per_step"] == [900.0, 950.0]


def test_the_fusion_side_profiles_its_fewest_and_most_adapters_and_says_where_the_step_grew(tmp_path, monkeypatch):
    """The fewest and the most adapters run first, so that a part cut at its limit (fusion8b's 120 s) has already
    written both ends' figures and where the step grew; the counts between come after, the figures in count order."""
    written = []
    write = fusion_side.write
    monkeypatch.setattr(fusion_side, "write", lambda args, result: (written.append(json.loads(json.dumps(result))),
                                                                     write(args, result)))
    args = argparse.Namespace(shape="tiny", adapters="1,2,4", warmup=1, steps=2, profile=tmp_path / "profile",
                              result=tmp_path / "fusion.json")
    result = fusion_side.fusion_side(args, torch.device("cpu"))
    assert list(result["efficiency"]) == ["1", "2", "4"] and list(result["per_adapters"]) == ["1", "2", "4"]
    assert result["efficiency"]["1"] == 1.0
    both_ends = next(snapshot for snapshot in written if "4" in snapshot["efficiency"] and "profile_growth" in snapshot)
    assert "2" not in both_ends["efficiency"]   # written before the count between ran
    fewest, most = tmp_path / "profile" / "adapters-1", tmp_path / "profile" / "adapters-4"
    assert (fewest / "summary.json").exists() and not (fewest / "trace.json.gz").exists()   # one trace: the most's
    assert (most / "trace.json.gz").exists() and not (tmp_path / "profile" / "adapters-2").exists()
    assert result["profile"]["adapters"] == 4
    growth = result["profile_growth"]
    assert growth["adapters"] == [1, 4] and len(growth["grew_most"]) == 12
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (fewest, most)]
    top = growth["grew_most"][0]   # the operators' self CPU time a step at each end, as the profiles counted it
    assert top["seconds_per_step"] == [summaries[0]["seconds_per_step_by_name"].get(top["name"], 0.0),
                                       summaries[1]["seconds_per_step_by_name"].get(top["name"], 0.0)]
    assert top["grew_s"] == max(row["grew_s"] for row in growth["grew_most"])
    assert json.loads(args.result.read_text())["profile_growth"] == growth   # written, as the part reads it
