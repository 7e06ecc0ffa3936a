"""A job's `epochs` raised on a pipeline trainer (`stages: 2`): `aspen run --in-process` again continues it from its
checkpoint on the stages (its head's plan and the stages' optimizers to the new total, its next accumulation begun
afresh), against one device as the reference: the job given the larger epochs at once on one device, or (its first
epoch's last step ended short by its data) the same raise on one device; a GRPO job replaying its generations too.
CPU, float32, one thread in every process: tests/service/test_pipeline_trainer.py says why such a pipeline is
exact."""

from __future__ import annotations

import json

import pytest
import torch

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from tests.helpers.pipeline import one_thread_per_process
from tests.helpers.service import adapter_tensors, job_dict, run_again, run_spec, write_task_data


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_per_process()


def test_epochs_raised_on_a_pipeline_continue_as_on_one_device(tmp_path, tiny_model_dirs):
    """16 rows in batches of 4 (grad_accum 1 and 2) and 20 rows with grad_accum 3 (1 epoch: steps of 3 and 2
    micro-batches, the data then ended mid-accumulation; 2 epochs at once plan 4 steps too), each 1 epoch on a
    pipeline, then raised to 2 there: the first two end exactly as one device's jobs given 2 epochs at once, the
    third exactly as the same raise on one device (its next epoch's accumulation begun afresh, as the first's)."""
    model = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    rows = {"ga1": write_task_data(data, "s", rows=16), "ga2": write_task_data(data, "s", rows=16),
            "ga3": write_task_data(data, "t", rows=20)}

    def spec(folder: str, epochs: float, names=tuple(rows), stages: int = 2):
        jobs = [job_dict(name, rows[name], None, epochs=epochs, lr_schedule="constant", grad_accum=int(name[2:]))
                for name in names]
        return run_spec(model, tmp_path / folder, jobs, step_tokens=1024).model_copy(
            update={"stages": stages, "stage_split": "even"})

    def one_device():
        return load_base_model(model, dtype="float32", device="cpu")

    first = train_locally(spec("staged", 1), progress=False, trainer={"threads": 1},
                          record_in=tmp_path / "staged/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 4), ("completed", 2), ("completed", 2)]
    again = run_again(spec("staged", 2), trainer={"threads": 1})
    assert [(s.state, s.steps) for s in again] == [("completed", 8), ("completed", 4), ("completed", 4)]

    train_locally(spec("at_once", 2, ("ga1", "ga2"), 1), base=one_device(), progress=False)
    train_locally(spec("single", 1, ("ga3",), 1), base=one_device(), progress=False,
                  record_in=tmp_path / "single/.aspen")
    run_again(spec("single", 2, ("ga3",), 1), base=one_device())
    for name, reference in (("ga1", "at_once"), ("ga2", "at_once"), ("ga3", "single")):
        ours, theirs = adapter_tensors(tmp_path / "staged" / name), adapter_tensors(tmp_path / reference / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
        metrics = [[json.loads(line) for line in (tmp_path / folder / name / "metrics.jsonl").read_text().splitlines()]
                   for folder in ("staged", reference)]
        assert [(r["step"], r["tokens"], r["loss"]) for r in metrics[0]] == \
            [(r["step"], r["tokens"], r["loss"]) for r in metrics[1]], name
    state = json.loads((tmp_path / "staged/ga3/checkpoint/state.json").read_text())
    assert (state["cursor"]["epoch"], state["cursor"]["position"], state["cursor"]["examples_seen"]) == (1, 20, 40)


def test_a_grpo_job_replaying_its_generations_continues_its_raised_epochs_on_a_pipeline_as_on_one_device(
        tmp_path, tiny_model_dirs):
    """GRPO with num_iterations 2 (2 micro-batches of 2 prompts a generation) on 8 rows, 1 epoch on a pipeline, raised
    to 2 there: exactly the adapter and metrics (rewards included) of the job given 2 epochs at once on one device."""
    model = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "arith", rows=8)

    def spec(folder: str, epochs: float, stages: int = 2):
        job = job_dict("grpo", data, None, epochs=epochs, lr_schedule="constant", method="grpo", batch_size=2,
                       grad_accum=2, max_seq_len=64, grpo={"reward": "contains", "num_generations": 3,
                                                           "max_new_tokens": 6, "num_iterations": 2})
        return run_spec(model, tmp_path / folder, [job], step_tokens=2048).model_copy(
            update={"stages": stages, "stage_split": "even"})
    first = train_locally(spec("staged", 1), progress=False, trainer={"threads": 1},
                          record_in=tmp_path / "staged/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 4)], first[0].reason
    again = run_again(spec("staged", 2), trainer={"threads": 1})
    assert [(s.state, s.steps) for s in again] == [("completed", 8)], again[0].reason
    train_locally(spec("at_once", 2, 1), base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    ours, theirs = adapter_tensors(tmp_path / "staged/grpo"), adapter_tensors(tmp_path / "at_once/grpo")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    metrics = [[json.loads(line) for line in (tmp_path / folder / "grpo/metrics.jsonl").read_text().splitlines()]
               for folder in ("staged", "at_once")]
    assert [(r["step"], r["reward"], r["loss"]) for r in metrics[0]] == \
        [(r["step"], r["reward"], r["loss"]) for r in metrics[1]]
