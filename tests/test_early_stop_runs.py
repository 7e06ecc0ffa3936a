"""Early stop in whole runs on a tiny random model, in-process (the service's scheduler core, trainer
loop, job data and stop rule): a job that has memorised its one repeated example stops long before its
budget, and a job paused and resumed stops at the same step as one never paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actors.engine.models import load_base_model
from actors.service.local_run import train_locally
from tests.conftest import tiny_model
from tests.service_helpers import job_dict, run_spec

ROW = {"question": "what is 17 and 25", "answer": "42, said the tiny model"}


@pytest.fixture(scope="module")
def memorising_model(tmp_path_factory, smol_tokenizer) -> Path:
    """The tiny random llama with a 20x larger output layer: its logits can get confident enough for an
    adapter to drive the loss of a memorised example near 0 (with the usual 0.02 init they cannot)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    folder = tmp_path_factory.mktemp("memorising-llama")
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def one_example(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "one.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


def memorising_job(data: Path, **extra) -> dict:
    """One example, repeated every step (batch 1, a 300-step budget), learnt fast by an all-linear adapter."""
    return job_dict("one", data, 300, batch_size=1, lr=1e-2, checkpoint_every=1000,
                    lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}, **extra)


def test_a_memorised_repeated_example_stops_early(tmp_path, memorising_model):
    """`early_stop: {min_improvement: 0.01}` as a new user writes it: the loss falls from ~16 to ~1e-3
    within 20 steps and then only creeps (still > 1% better in relative terms); the job stops before step
    100 of its 300 steps, by the absolute `min_delta` (0.1% of its first loss)."""
    base = load_base_model(str(memorising_model), dtype="float32", device="cpu")
    job = memorising_job(one_example(tmp_path / "data"), early_stop={"min_improvement": 0.01})
    (summary,) = train_locally(run_spec(str(memorising_model), tmp_path / "out", [job]), base=base, progress=False)
    losses = [json.loads(r)["loss"] for r in (tmp_path / "out/one/metrics.jsonl").read_text().splitlines()]
    assert summary.state == "stopped_early" and summary.steps < 100, (summary.steps, summary.reason)
    assert len(losses) == summary.steps
    assert losses[-1] < 1e-2 * losses[0]                       # it had learnt its example
    first_window, last_window = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert "min_delta" in summary.reason and f"first train loss {losses[0]:.4g}" in summary.reason, summary.reason
    assert first_window - last_window > 0.9 * first_window
