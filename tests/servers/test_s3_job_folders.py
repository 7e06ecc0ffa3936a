"""A job folder that is a storage URI (s3://, against a real S3-compatible server) is treated as a folder on disk
is: a job starting over there deletes only the objects aspen writes (its adapter, metrics, TensorBoard events, the
checkpoint pointer and its uploads), never a user's own objects beside them (every object under the prefix was
deleted); and outputs copied there from another run, which no table knows, are refused to a new job by the service
and by `aspen run`'s plan, naming whose they are and at which step (a URI was not looked into). The reference for
what the new run leaves is a run into an empty prefix."""

from __future__ import annotations

import hashlib
import logging

import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import load as load_safetensors

from actors.service.outputs.earlier_outputs import earlier_outputs
from actors.service.outputs.job_files import aspen_output, clear_job_folder
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduler_core import SchedulerCore, SubmissionConflict
from actors.service.table.job_table import JobTable
from actors.storage.checkpoint_mirror import read_pointer
from actors.storage.storage_location import StorageLocation
from orchestrator.run_plan import plan_run
from policies.fifo import FifoPolicy
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, run_spec, write_task_data

STEPS = 3


def _raw_s3(server) -> pafs.S3FileSystem:
    """The server's objects without aspen's storage module (to copy a folder as a user's tool would)."""
    return pafs.S3FileSystem(endpoint_override=server.endpoint.split("://", 1)[1], scheme="http",
                             access_key="testing", secret_key="testing", region="us-east-1", request_timeout=60)


def _objects(server, prefix: str) -> dict[str, str]:
    """Every object under `prefix` (bucket/...): its name relative to it -> its sha256."""
    fs = _raw_s3(server)
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
    digests = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                digests[info.path[len(prefix) + 1:]] = hashlib.sha256(stream.read()).hexdigest()
    return digests


def _adapter(location: StorageLocation) -> dict[str, torch.Tensor]:
    return load_safetensors(location.read_bytes("adapter_model.safetensors"))


def test_starting_over_in_an_s3_folder_deletes_aspens_objects_and_keeps_the_users(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "rows", "sql")
    uri = f"s3://{s3_bucket}/out"
    first = job_dict("sql", data, STEPS, checkpoint_every=1, tracking={"tensorboard": True})
    [summary] = train_locally(run_spec(base, uri, [first]), base=tiny_base, progress=False)
    assert summary.state == "completed", summary.reason
    folder = StorageLocation(f"{uri}/sql")
    assert read_pointer(folder)["step"] == STEPS and folder.list("tb")
    folder.write_bytes("notes.txt", b"what I tried\n")
    folder.write_bytes("data/train.jsonl", b'{"question": "q", "answer": "a"}\n')

    train_locally(run_spec(base, uri, [job_dict("sql", data, 2)]), base=tiny_base, progress=False)
    train_locally(run_spec(base, f"s3://{s3_bucket}/fresh", [job_dict("sql", data, 2)]), base=tiny_base,
                  progress=False)
    fresh = StorageLocation(f"s3://{s3_bucket}/fresh/sql")
    assert folder.read_bytes("notes.txt") == b"what I tried\n" and folder.exists("data/train.jsonl")
    assert [name for name in folder.list() if aspen_output(name, uri=True)] == fresh.list()   # no tb, no pointer
    assert [row.count(b'"step"') for row in folder.read_bytes("metrics.jsonl").splitlines()] == [1, 1]
    ours, reference = _adapter(folder), _adapter(fresh)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[key], reference[key]) for key in ours)

    clear_job_folder(folder.uri)
    assert folder.list() == ["data", "notes.txt"]


def test_outputs_copied_to_an_s3_folder_are_refused_to_a_new_job_and_kept(
        s3_server, s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "rows", "a")
    job = job_dict("a", data, STEPS, checkpoint_every=1)
    [summary] = train_locally(run_spec(base, f"s3://{s3_bucket}/out", [job]), base=tiny_base, progress=False)
    assert summary.state == "completed", summary.reason
    pafs.copy_files(f"{s3_bucket}/out/a", f"{s3_bucket}/copy/a", source_filesystem=_raw_s3(s3_server),
                    destination_filesystem=_raw_s3(s3_server))
    before = _objects(s3_server, f"{s3_bucket}/copy/a")
    assert before == _objects(s3_server, f"{s3_bucket}/out/a")

    found = earlier_outputs(f"s3://{s3_bucket}/copy/a")
    assert found is not None and (found.job, found.step, found.checkpoint_step) == ("a", STEPS, STEPS)
    assert found.describe().startswith(f"job 'a' at step {STEPS}: its adapter (aspen.json), a checkpoint at step "
                                       f"{STEPS}, metrics.jsonl ({STEPS} rows); last written "), found.describe()
    assert earlier_outputs(f"s3://{s3_bucket}/nothing/a") is None

    [submission] = run_spec(base, f"s3://{s3_bucket}/copy", [job]).submissions()
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    with pytest.raises(SubmissionConflict, match=rf"s3://{s3_bucket}/copy/a holds the outputs of a job this service "
                                                 rf"has no record of \(job 'a' at step {STEPS}: "):
        core.submit(submission)
    assert core.table.all() == []
    plan = plan_run([submission], [], lambda job_id: submission, found_outputs=earlier_outputs)   # `aspen run`'s
    assert [(name, found.job, found.step) for name, found in plan.foreign] == [("a", "a", STEPS)]
    assert _objects(s3_server, f"{s3_bucket}/copy/a") == before   # nothing of it written over


def test_an_s3_folder_the_scheduler_cannot_reach_is_entered_with_a_warning(
        s3_bucket, tmp_path, tiny_model_dirs, monkeypatch, caplog):
    """The scheduler's node may lack the store's endpoint or credentials that its trainers have: the job is entered,
    and the log says its folder was not looked into (its trainer checks the store when the job starts)."""
    [submission] = run_spec(str(tiny_model_dirs["llama"]), f"s3://{s3_bucket}/out",
                            [job_dict("a", tmp_path / "a.jsonl", 2)]).submissions()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    with caplog.at_level(logging.WARNING, logger="actors.service.scheduler.submissions"):
        record = core.submit(submission)
    assert record.output_dir == f"s3://{s3_bucket}/out/a"
    [warning] = [r.getMessage() for r in caplog.records if "was not looked into" in r.getMessage()]
    assert warning.startswith(f"s3://{s3_bucket}/out/a was not looked into for an earlier run's outputs (")
    assert "cannot be reached" in warning


def test_a_raise_its_data_already_ran_through_says_it_trains_nothing_on_s3_too(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs, monkeypatch, capsys):
    """4 rows in batches of 4, 1.5 epochs: 2 steps, its data read twice (as a job given 2 epochs at once: the
    reference). Its outputs on a storage URI, a raise to 2 epochs was said by `aspen run`'s plan to continue it from
    its checkpoint (the checkpoint's cursor was looked into only on disk): now it says it trains nothing more and why,
    as for a folder on disk (tests/unit/service/test_extend_refusals.py), and the service's extend refuses it."""
    from actors.service.scheduler.config import run_local_dir
    from actors.service.table.job_table import read_jobs
    from tests.helpers.service import run_again

    monkeypatch.setenv("HOME", str(tmp_path))   # the run's state: ~/.aspen/runs/<bucket-and-prefix>
    base, data = tiny_model_dirs["llama"], write_task_data(tmp_path / "data", "t", rows=4)

    def spec(epochs: float, folder: str = f"s3://{s3_bucket}/out"):
        return run_spec(str(base), folder, [job_dict("half", data, None, epochs=epochs, lr_schedule="constant")],
                        step_tokens=1024)
    state = run_local_dir(spec(1.5)) / ".aspen"
    first = train_locally(spec(1.5), base=tiny_base, progress=False, record_in=state)
    reference = train_locally(spec(2, str(tmp_path / "reference")), base=tiny_base, progress=False)
    assert [s.steps for s in first] == [s.steps for s in reference] == [2]
    capsys.readouterr()

    again = run_again(spec(2), base=tiny_base, state=state)
    out = capsys.readouterr().out
    assert "it continues from its checkpoint" not in out, out
    assert ("half: epochs raised to 2, but it is at its data's end: its checkpoint at step 2 has read each of its 4 "
            "training examples 2 time(s)") in out, out
    assert [(s.state, s.steps) for s in again] == [("completed", 2)]
    table = JobTable(state / "jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), state)
    (record, submission), = read_jobs(state / "jobs.sqlite")
    raised = submission.model_copy(update={"job": submission.job.model_copy(update={"epochs": 2})})
    with pytest.raises(ValueError, match=r"is at its data's end: .* the new total is step 2, the step it is at"):
        core.extend(record.id, raised)
    table.close()
