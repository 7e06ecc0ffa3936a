"""A trainer that loses a job's end report (a trainer bug: one such kept a pipeline job "running" for ever) costs
the job nothing: the scheduler sees the trainer stop listing the job without an end, queues it again from its
last checkpoint, and the run ends with every job as an undisturbed run ends it. In this process (`aspen run
--in-process`'s driver, which runs the service's scheduler core and trainer loop), with the report dropped by
patching the trainer's job (nothing else is changed)."""

from __future__ import annotations

import json
import logging

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from actors.service.trainer.active_job import ActiveJob
from tests.helpers.service import adapter_tensors, job_dict, max_relative_difference, run_spec, write_task_data


def metric_steps(folder) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_jobs_lost_end_report_is_found_and_the_job_ends_as_undisturbed(tmp_path, tiny_model_dirs, monkeypatch,
                                                                          caplog):
    model = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    jobs = [job_dict("first", write_task_data(data, "first"), 4, checkpoint_every=2),
            job_dict("second", write_task_data(data, "second", offset=3), 10, checkpoint_every=2)]
    report_end, lost = ActiveJob.report_end, []

    def loses_firsts_first_end(self, events, kind, data):
        if self.job.name == "first" and not lost:
            lost.append(kind)   # taken off the trainer, its results written, its end never reported
            return None
        return report_end(self, events, kind, data)

    monkeypatch.setattr(ActiveJob, "report_end", loses_firsts_first_end)
    with caplog.at_level(logging.ERROR):
        summaries = train_locally(run_spec(model, tmp_path / "out", jobs), progress=False, trainer={"threads": 1})
    assert lost == ["completed"], "no end report was lost: the test tested nothing"
    assert "no longer holds it and reported no end" in caplog.text
    assert [(s.name, s.state, s.steps) for s in summaries] == [("first", "completed", 4), ("second", "completed", 10)]
    monkeypatch.undo()
    train_locally(run_spec(model, tmp_path / "undisturbed", jobs), progress=False, trainer={"threads": 1},
                  base=load_base_model(model, dtype="float32", device="cpu"))
    for name, steps in (("first", 4), ("second", 10)):
        assert metric_steps(tmp_path / "out" / name) == list(range(1, steps + 1)), name
        difference = max_relative_difference(adapter_tensors(tmp_path / "out" / name),
                                             adapter_tensors(tmp_path / "undisturbed" / name))
        assert difference <= 1e-6, f"{name}: {difference:.2e} from an undisturbed run"
