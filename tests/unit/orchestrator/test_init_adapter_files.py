"""`init_adapter` as users write it: in a jobs file (a path relative to the file; a missing folder or a config
that does not fit the job's lora refused at its line, before anything starts), in a sweep file (relative to the
sweep file), over HTTP (a relative path refused: the service cannot tell what it is relative to), and the
settings that cannot go with it."""

from __future__ import annotations

import pytest
from peft import LoraConfig as PeftLoraConfig
from pydantic import ValidationError

from actors.spec.job_spec import JobSpec
from orchestrator.jobs_file import SpecError, load_run_spec
from tests.helpers.service import write_task_data

JOBS = """\
base_model: smollm2-135m
jobs:
  - name: continued
    data: data/q.jsonl
    format: {{type: prompt_response, prompt: "{{question}}", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    init_adapter: {adapter}
"""


def _adapter(folder, r: int = 4):
    """A PEFT adapter's config, as PEFT writes it."""
    PeftLoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"]).save_pretrained(folder)
    return folder


def test_a_jobs_files_adapter_is_the_files_and_one_that_does_not_fit_is_refused_at_its_line(tmp_path):
    write_task_data(tmp_path / "data", "q")
    _adapter(tmp_path / "adapters" / "sft")
    path = tmp_path / "jobs.yaml"
    path.write_text(JOBS.format(adapter="adapters/sft"))
    (job,) = load_run_spec(path).jobs
    assert job.init_adapter == tmp_path / "adapters" / "sft"

    _adapter(tmp_path / "adapters" / "wide", r=16)
    path.write_text(JOBS.format(adapter="adapters/wide"))
    with pytest.raises(SpecError) as caught:
        load_run_spec(path)
    assert str(caught.value) == (
        f"{path}:7: job 'continued' (jobs[0]), field init_adapter: {tmp_path / 'adapters/wide/adapter_config.json'} "
        "does not fit the job's lora: lora.r is 4, the adapter's r 16: set lora.r: 16")
    path.write_text(JOBS.format(adapter="adapters/none"))
    with pytest.raises(SpecError, match=rf"{path}:7: job 'continued' \(jobs\[0\]\), field init_adapter: "
                                        rf"{tmp_path / 'adapters/none/adapter_config.json'} does not exist; give a "
                                        "folder holding adapter_config.json and adapter_model.safetensors"):
        load_run_spec(path)
    assert load_run_spec(path, check_files=False).jobs[0].init_adapter == tmp_path / "adapters" / "none"


def test_a_sweeps_adapter_is_relative_to_the_sweep_file_and_fixes_the_adapters_shape(tmp_path):
    from orchestrator.sweep import load_sweep_spec

    write_task_data(tmp_path / "data", "q")
    _adapter(tmp_path / "sft")
    path = tmp_path / "sweep.yaml"
    path.write_text("name: lrs\noutput_dir: runs/lrs\njob:\n  name: t\n  data: data/q.jsonl\n"
                    "  format: {type: prompt_response, prompt: '{question}', response: ' {answer}'}\n"
                    "  lora: {r: 4, alpha: 8}\n  init_adapter: sft\n  max_steps: 8\n  eval_split: 4\n  eval_every: 4\n"
                    "space:\n  lr: {loguniform: [1.0e-5, 1.0e-3]}\ntrials: 2\n")
    assert load_sweep_spec(path).job.init_adapter == tmp_path / "sft"
    path.write_text(path.read_text().replace("space:\n", "space:\n  lora.r: {choice: [4, 8]}\n"))
    with pytest.raises(SpecError, match=r"space.lora.r: every trial starts from job.init_adapter, whose lora.r is "
                                        r"fixed; leave lora.r out of the space"):
        load_sweep_spec(path)


@pytest.mark.parametrize("extra,expected", [
    ({"method": "interactive", "data": None, "format": None}, "an interactive model starts from a saved state of "
                                                               "its own"),
    ({"lora": {"init_lora_weights": "pissa"}}, "lora.init_lora_weights: 'pissa' initialises the adapter, and "
                                               "init_adapter starts it from saved weights instead"),
])
def test_settings_that_cannot_go_with_a_saved_adapter_are_refused(extra, expected):
    fields = {"name": "j", "data": "d.jsonl", "format": {"type": "text"}, "init_adapter": "/adapters/sft", **extra}
    with pytest.raises(ValidationError, match=expected):
        JobSpec.model_validate(fields)


def test_http_refuses_a_relative_adapter_path():
    from orchestrator.http.request_bodies import _path_problems

    (problem,) = _path_problems({"jobs": [{"data": "/d.jsonl", "init_adapter": "adapters/sft"}]}, True, None)
    assert problem["loc"] == ["init_adapter"] and problem["type"] == "relative_path"
    assert "relative path 'adapters/sft': the service cannot tell what it is relative to" in problem["msg"]


def _chain_file(tmp_path, second: str, third: str = "none", second_lora: str = "{r: 4, alpha: 8}") -> str:
    write_task_data(tmp_path / "data", "q")
    jobs = ["base_model: smollm2-135m", "jobs:"]
    for name, adapter, lora in (("sft", "none", "{r: 4, alpha: 8}"), ("dpo", second, second_lora),
                                ("more", third, "{r: 4, alpha: 8}")):
        jobs += [f"  - name: {name}", "    data: data/q.jsonl",
                 '    format: {type: prompt_response, prompt: "{question}", response: " {answer}"}',
                 f"    lora: {lora}"]
        if adapter != "none":
            jobs.append(f"    init_adapter: {adapter}")
    (tmp_path / "jobs.yaml").write_text("\n".join(jobs) + "\n")
    return str(tmp_path / "jobs.yaml")


@pytest.mark.parametrize("second,third,lora,expected", [
    ("job:sft", "job:dpo", "{r: 4, alpha: 8}", None),
    ("job:nope", "none", "{r: 4, alpha: 8}",
     ":11: job 'dpo' (jobs[1]), field init_adapter: job:nope names no job of the same submission (the others: more, "
     "sft); name one of them, or give the folder of a finished job's adapter"),
    ("job:dpo", "none", "{r: 4, alpha: 8}",
     ":11: job 'dpo' (jobs[1]), field init_adapter: job:dpo is this job itself; name another job of the same "
     "submission"),
    ("job:more", "job:dpo", "{r: 4, alpha: 8}",
     ":11: job 'dpo' (jobs[1]), field init_adapter: job:more makes a cycle (dpo -> more -> dpo): each job would wait "
     "for the other's adapter"),
    ("job:sft", "none", "{r: 8, alpha: 8}",
     ":11: job 'dpo' (jobs[1]), field init_adapter: job 'sft' saves an adapter that does not fit this job's lora: "
     "lora.r is 8, the adapter's r 4: set lora.r: 4"),
    ("job:sft", "none", "{r: 4, alpha: 8, target_modules: [q_proj, k_proj]}",
     ":11: job 'dpo' (jobs[1]), field init_adapter: job 'sft' saves an adapter that does not fit this job's lora: "
     "lora.target_modules is ['q_proj', 'k_proj'], job 'sft' adapts ['q_proj', 'v_proj']: set lora.target_modules: "
     "['q_proj', 'v_proj']"),
], ids=["chain", "unknown", "itself", "cycle", "rank", "modules"])
def test_a_job_started_from_another_jobs_adapter_is_checked_at_its_line(tmp_path, second, third, lora, expected):
    path = _chain_file(tmp_path, second, third, lora)
    if expected is None:
        jobs = load_run_spec(path).jobs
        assert [str(job.init_adapter) for job in jobs] == ["None", "job:sft", "job:dpo"]
        return
    with pytest.raises(SpecError) as caught:
        load_run_spec(path)
    assert str(caught.value).startswith(path + expected), str(caught.value)


def test_a_sweeps_trials_cannot_start_from_another_job():
    from actors.spec.sweep_spec import SweepSpec

    with pytest.raises(ValidationError, match="job.init_adapter: job:sft names another job, and a sweep's trials are "
                                              "its only jobs"):
        SweepSpec.model_validate({"name": "s", "output_dir": "/runs/s", "trials": 2, "objective": "train_loss",
                                  "space": {"lr": {"loguniform": [1e-5, 1e-3]}},
                                  "job": {"name": "t", "data": "/d.jsonl", "format": {"type": "text"},
                                          "init_adapter": "job:sft"}})
    from orchestrator.http.request_bodies import _path_problems

    assert _path_problems({"jobs": [{"data": "/d.jsonl", "init_adapter": "job:sft"}]}, True, None) == []


def test_running_a_chained_file_again_does_not_take_the_resolved_adapter_for_a_change():
    """`aspen run` again: the table holds the folder `job:sft` became; the file still says job:sft, which is no change
    (the sft job's own changes are its); a folder changed for another is one."""
    from actors.spec.job_submission import JobSubmission
    from actors.spec.submission_changes import differences

    def submission(adapter: str) -> JobSubmission:
        return JobSubmission.model_validate({"base_model": "smollm2-135m", "job": {
            "name": "dpo", "data": "/d.jsonl", "format": {"type": "text"}, "init_adapter": adapter}})

    assert differences(submission("/runs/out/sft"), submission("job:sft")) == []
    assert differences(submission("/runs/out/sft"), submission("/runs/other/sft")) == [
        "init_adapter: '/runs/out/sft' -> '/runs/other/sft'"]


def test_running_a_chained_file_again_names_a_carried_source_by_its_id():
    """The sft job done in the last run is carried over, not submitted: the dpo job submitted again names it by its
    id, which a service with other jobs named sft finds all the same."""
    from actors.service.table.job_record import JobRecord
    from actors.spec.job_submission import JobSubmission
    from orchestrator.run_plan import plan_run

    def submission(name: str, adapter: str | None = None) -> JobSubmission:
        return JobSubmission.model_validate({"base_model": "smollm2-135m", "output_dir": f"/runs/{name}", "job": {
            "name": name, "data": "/d.jsonl", "format": {"type": "text"},
            **({"init_adapter": adapter} if adapter else {})}})

    sft = submission("sft")
    done = JobRecord(id="sft-1a2b3c", name="sft", state="completed", reason="", base_model="smollm2-135m",
                     quantization="none", priority=0, output_dir="/runs/sft", trainer=None, step=4, total_steps=4,
                     tokens=10, loss=1.0, eval_loss=None, tokens_per_s=None, checkpoint_step=4,
                     adapter_dir="/runs/sft", submitted_at=1.0, started_at=2.0, finished_at=3.0, updated_at=3.0)
    plan = plan_run([sft, submission("dpo", "job:sft")], [done], lambda job_id: sft)
    assert plan.done == [done]
    (dpo,) = plan.submit
    assert type(dpo.job.init_adapter).__name__ == "JobAdapter" and dpo.job.init_adapter == "job:sft-1a2b3c"
