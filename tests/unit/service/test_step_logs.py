"""Each trainer of a run's kind writes its own step log: two trainers of `run_service_config(...,
trainer={"count": 2})` (whose step_log is the run's trainer.jsonl) keep their steps apart, each file holding
exactly the steps of the job that trainer ran."""

from __future__ import annotations

import json

import actors.service.trainer.step_admission as step_admission
from actors.engine.models import load_base_model
from actors.service.scheduler.config import run_service_config
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle


def test_two_trainers_of_one_kind_write_separate_step_logs(tmp_path, tiny_model_dirs, monkeypatch):
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    # both trainers hold the same model: its activation probe (seconds) is measured by the first, kept, read by the
    # second (actors/engine/probe_cache.py), in this test's own cache folder
    monkeypatch.setenv("ASPEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(step_admission, "MEASURE_FIRST", 0)   # the allocator's count (torch.profiler, slow on CPU)
    monkeypatch.setattr(step_admission, "MEASURE_EVERY", 10**9)   # only on each trainer's first step
    data = tmp_path / "data"
    steps = {"a": 2, "b": 1}
    jobs = [job_dict(name, write_task_data(data, name, rows=16, offset=i), count, max_seq_len=32)
            for i, (name, count) in enumerate(steps.items())]
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", jobs, step_tokens=256)
    config = run_service_config(spec, state_dir=tmp_path / "state", trainer={"count": 2}).trainers[0]
    assert config.count == 2 and config.step_log == tmp_path / "out" / "trainer.jsonl"
    loops = [TrainerLoop(base, config, f"trainer-{i}", tmp_path / "state") for i in range(2)]
    for loop, submission in zip(loops, spec.submissions(), strict=True):
        loop.assign(assignment_for(submission, submission.job.name, base.tokenizer))
    for loop in loops:   # in turn, each to its end, both logs open at once
        run_until_idle(loop)
    for loop in loops:
        loop.close()
    assert not (tmp_path / "out" / "trainer.jsonl").exists()
    for i, name in enumerate(steps):
        rows = [json.loads(line) for line in (tmp_path / "out" / f"trainer.trainer-{i}.jsonl").read_text().splitlines()]
        assert [row["jobs"] for row in rows] == [[name]] * steps[name]
