"""`aspen run` again with a job's `max_steps` raised, as transformers' `resume_from_checkpoint` with a larger
`max_steps`: the finished job continues from its checkpoint to the new budget (a job beside it, unchanged, is left
alone), and with `lr_schedule: constant` it ends as a run given that budget from the start. A lowered budget, or
the budget raised beside another change, is a changed spec as before (exit 2, `--overwrite`). In-process and
through the service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from orchestrator.jobs_file import load_run_spec
from tests.helpers.interrupted_runs import NO_RAY, finish, metric_steps
from tests.helpers.interrupted_runs import write_run as write_interrupted_run
from tests.helpers.service import adapter_tensors, max_relative_difference


def write_run(folder: Path, base: Path, first: int, lr: str = "1.0e-3") -> None:
    """tests/helpers/interrupted_runs.py's two jobs of 6 steps at a constant learning rate, the first's `max_steps`
    and `lr` as given."""
    path = write_interrupted_run(folder, base, steps=6, lr=lr, every=1000)
    text = path.read_text().replace("    lr: ", "    lr_schedule: constant\n    lr: ")
    path.write_text(text.replace("max_steps: 6", f"max_steps: {first}", 1))


def aspen_run(folder: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    return finish(subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--quiet", "jobs.yaml", *args],
                                   cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, env=env))


def assert_like_a_run_of(folder: Path, base: Path, name: str, steps: int) -> None:
    """`name`'s adapter and losses are those of a run given `steps` from the start (in this process)."""
    spec = load_run_spec(folder / "jobs.yaml")
    job = next(job for job in spec.jobs if job.name == name).model_copy(update={"max_steps": steps})
    reference = folder / "reference"
    train_locally(spec.model_copy(update={"output_dir": reference, "jobs": [job]}),
                  base=load_base_model(str(base), dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(folder / "out" / name), adapter_tensors(reference / name))
    assert difference <= 1e-4, f"{name}: {difference:.2e} from a run of {steps} steps"
    ours, theirs = ([json.loads(line)["loss"] for line in (where / name / "metrics.jsonl").read_text().splitlines()]
                    for where in (folder / "out", reference))
    assert ours == pytest.approx(theirs, rel=1e-4)


def raised_run(tmp_path: Path, base: Path, again: tuple[str, ...], env: dict[str, str] | None) -> None:
    write_run(tmp_path, base, first=6)
    code, out, err = aspen_run(tmp_path, "--in-process", env=NO_RAY)
    assert code == 0, (out, err)
    second = (tmp_path / "out/second/adapter_model.safetensors").read_bytes()

    write_run(tmp_path, base, first=5)   # lowered: a changed spec, as before
    code, out, err = aspen_run(tmp_path, *again, env=NO_RAY)
    assert code == 2 and "job 'first': max_steps: 6 -> 5" in err and "--overwrite" in err, (code, out, err)
    write_run(tmp_path, base, first=10, lr="2.0e-3")   # raised beside another change: changed too
    code, out, err = aspen_run(tmp_path, *again, env=NO_RAY)
    assert code == 2 and "lr: 0.001 -> 0.002" in err and "max_steps: 6 -> 10" in err, (code, out, err)

    write_run(tmp_path, base, first=10)
    code, out, err = aspen_run(tmp_path, *again, env=env)
    assert code == 0, (out, err)
    assert "first: completed at step 6; max_steps raised to 10: it continues from its checkpoint at step 6" in out, out
    assert "second: already completed at step 6; left alone" in out, out
    assert metric_steps(tmp_path / "out/first") == list(range(1, 11))
    assert (tmp_path / "out/second/adapter_model.safetensors").read_bytes() == second
    assert_like_a_run_of(tmp_path, base, "first", 10)
    code, out, err = aspen_run(tmp_path, *again, env=NO_RAY)   # and once more: done at its new budget
    assert code == 0 and "first: already completed at step 10; left alone" in out, (out, err)


def test_a_raised_max_steps_continues_the_finished_job_in_process(tmp_path, tiny_model_dirs):
    raised_run(tmp_path, tiny_model_dirs["llama"], ("--in-process",), NO_RAY)


@pytest.mark.long
def test_a_raised_max_steps_continues_the_finished_job_through_the_service(tmp_path, tiny_model_dirs):
    raised_run(tmp_path, tiny_model_dirs["llama"], (), None)


EARLY_STOPPED = """\
base_model: {base}
output_dir: out
step_tokens: 1024
jobs:
  - name: es
    data: data/t.jsonl
    format: {{type: prompt_response, prompt: "Q: {{question}}\\nA:", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 4
    max_seq_len: 128
    lr_schedule: constant
    epochs: {epochs}
    eval_every: 1
    early_stop: {{min_improvement: 100, patience: 1}}
"""


@pytest.mark.long
@pytest.mark.parametrize("way", ["service", "in-process"])
def test_a_raised_epochs_whose_stop_rule_fires_is_told_alike_through_the_service(tmp_path, tiny_model_dirs, way):
    """`aspen run` of tests/unit/service/test_epochs_raised.py's job (10 rows in batches of 4: 1 epoch is 3 steps, too
    few for its rule to judge one), then again with epochs raised to 2: it continues from its checkpoint at step 3 and
    its rule stops it judging step 4 of its new total (6), exit 0; run once more it is left alone. Through the
    service and in process alike: the same lines, state and step as that in-process test's `train_locally`."""
    import json as json_lines

    from actors.service.table.job_table import read_jobs

    data = tmp_path / "data" / "t.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json_lines.dumps({"question": f"n {i}", "answer": f"{i}"}) + "\n" for i in range(10)))
    command = () if way == "service" else ("--in-process",)
    (tmp_path / "jobs.yaml").write_text(EARLY_STOPPED.format(base=tiny_model_dirs["llama"], epochs=1))
    code, out, err = aspen_run(tmp_path, *command)
    assert code == 0 and "completed" in out, (out, err)
    (tmp_path / "jobs.yaml").write_text(EARLY_STOPPED.format(base=tiny_model_dirs["llama"], epochs=2))
    code, out, err = aspen_run(tmp_path, *command)
    assert code == 0, (out, err)
    assert "es: completed at step 3; epochs raised to 2: it continues from its checkpoint at step 3" in out, out
    (record, _), = read_jobs(tmp_path / "out/.aspen/jobs.sqlite")
    assert record.state == "stopped_early" and 4 <= record.step < 6 and "(step 4" in record.reason, record
    assert "stopped_early" in out, out   # the run's end table
    code, out, err = aspen_run(tmp_path, *command, env=NO_RAY)
    assert code == 0 and f"es: already stopped_early at step {record.step}; left alone" in out, (out, err)
