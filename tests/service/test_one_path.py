"""One training path: the same jobs file through the service on Ray and in this process (which only swaps
Ray's transport for direct calls) gives the same steps, the same early stop at the same step, the same
evaluations and checkpoints, and equal adapters; both write each job's eval losses into its folder
(metrics.jsonl), where `aspen report` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.checkpoint import saved_step
from actors.engine.models import load_base_model
from actors.service.outputs.job_files import CHECKPOINT_FOLDER
from actors.service.scheduler.config import run_service_config
from actors.service.scheduler.local_run import train_locally
from orchestrator.client import Client
from orchestrator.report import collect, read_metrics, report_data
from tests.helpers.service import adapter_tensors, job_dict, max_relative_difference, run_spec, write_task_data


def jobs(data: Path) -> list[dict]:
    flat = job_dict("flat", write_task_data(data, "flat"), 200, lr=1e-7, lr_schedule="constant", eval_split=8,
                    eval_every=2, checkpoint_every=5, early_stop={"min_improvement": 0.05, "patience": 3})
    learning = job_dict("learning", write_task_data(data, "learning", offset=3), 12, eval_split=4, eval_every=4,
                        checkpoint_every=5)
    return [flat, learning]


def outcome(run_dir: Path, evals: dict[str, list[tuple[int, float]]]) -> dict[str, dict]:
    found = {}
    for name in ("flat", "learning"):
        rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        found[name] = {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows],
                       "checkpoint": saved_step(run_dir / name / CHECKPOINT_FOLDER),
                       "adapter": adapter_tensors(run_dir / name), "evals": evals[name]}
    return found


def test_the_service_and_the_in_process_mode_train_the_same(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    in_process = run_spec(base, tmp_path / "in-process", jobs(data), step_tokens=512)
    summaries = {s.name: s for s in train_locally(in_process, base=load_base_model(base, dtype="float32",
                                                                                     device="cpu"), progress=False)}

    on_ray = run_spec(base, tmp_path / "service", jobs(data), step_tokens=512)
    client = Client.local(run_service_config(on_ray, tick_seconds=0.1, trainer={"num_cpus": 0.5, "threads": 1}))
    try:
        handles = client.submit_run(on_ray)
        records = {r.name: r for r in client.wait_all([h.id for h in handles], timeout=300)}
        service_evals = {name: [(row["step"], row["eval_loss"]) for row in client.losses(record.id)
                                if row.get("eval_loss") is not None] for name, record in records.items()}
    finally:
        client.shutdown()

    assert summaries["flat"].state == records["flat"].state == "stopped_early"
    assert summaries["learning"].state == records["learning"].state == "completed"
    assert summaries["flat"].steps == records["flat"].step < 200      # the same stop step
    local = outcome(tmp_path / "in-process", {name: s.evals for name, s in summaries.items()})
    service = outcome(tmp_path / "service", service_evals)
    for name in ("flat", "learning"):
        assert local[name]["steps"] == service[name]["steps"], name
        assert local[name]["losses"] == pytest.approx(service[name]["losses"], rel=1e-6), name
        assert [s for s, _ in local[name]["evals"]] == [s for s, _ in service[name]["evals"]], name
        assert [v for _, v in local[name]["evals"]] == pytest.approx([v for _, v in service[name]["evals"]],
                                                                     rel=1e-6), name
        assert local[name]["checkpoint"] == service[name]["checkpoint"] == local[name]["steps"][-1], name
        assert max_relative_difference(local[name]["adapter"], service[name]["adapter"]) <= 1e-6, name
    assert local["learning"]["evals"] and [s for s, _ in local["learning"]["evals"]] == [4, 8, 12]

    # each job's folder holds its eval losses (its metrics.jsonl rows), whichever way it ran: the service's
    # table (the reference here) and the in-process run's folder agree, and `aspen report` shows them
    for name in ("flat", "learning"):
        written = {mode: read_metrics(tmp_path / mode / name / "metrics.jsonl", name).evals
                   for mode in ("in-process", "service")}
        assert list(written["service"].items()) == service_evals[name], name
        assert list(written["in-process"]) == [step for step, _ in service_evals[name]], name
        assert list(written["in-process"].values()) == pytest.approx([v for _, v in service_evals[name]],
                                                                     rel=1e-6), name
    assert not (tmp_path / "in-process" / ".aspen").exists(), "the in-process run keeps no job table"
    reported = {job["job"]: job["evals"] for job in report_data(collect(tmp_path / "in-process"))}
    assert {name: [(e["step"], e["eval_loss"]) for e in evals] for name, evals in reported.items()} == \
        {name: list(read_metrics(tmp_path / "in-process" / name / "metrics.jsonl", name).evals.items())
         for name in ("flat", "learning")}


def test_a_final_evaluation_between_eval_steps_lands_in_the_last_row(tiny_model_dirs, tmp_path):
    """A job whose last step is not a multiple of eval_every is evaluated once more as it ends: that eval loss
    is in its last metrics.jsonl row (the file written again whole), and the rows before are as they were."""
    base = str(tiny_model_dirs["llama"])
    spec = run_spec(base, tmp_path / "run", [job_dict("odd", write_task_data(tmp_path / "data", "odd"), 5,
                                                      eval_split=4, eval_every=2)])
    (summary,) = train_locally(spec, base=load_base_model(base, dtype="float32", device="cpu"), progress=False)
    assert summary.state == "completed" and [step for step, _ in summary.evals] == [2, 4, 5]
    rows = [json.loads(line) for line in (tmp_path / "run/odd/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5] and all(row["loss"] > 0 for row in rows)
    assert [(row["step"], row["eval_loss"]) for row in rows if "eval_loss" in row] == summary.evals
    assert list(collect(tmp_path / "run")[0].evals.items()) == summary.evals
