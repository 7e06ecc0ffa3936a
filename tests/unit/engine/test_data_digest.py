"""A job's data digest (actors/data/digest.py), kept with its checkpoints, so that a data file whose
rows changed in place (same path, same row count) is not trained on by a resumed job:

- the digest of each kind of source changes when its rows do, and only then (local files read whole: their
  bytes; streamed files and files under a storage URI: their size and modification time, as documented);
- a checkpoint records it; a job whose data digest differs is refused by `load_checkpoint` with the job, the
  file and `--overwrite` named; a checkpoint of an older aspen (no digest) still resumes, and says so;
- the service's path: a job the trainer loop starts again from its checkpoint (after a pause, a lost trainer,
  a preemption) on changed data fails with that message, and on unchanged data resumes as before.
`aspen run` again on changed data (refused, exit 2; `--overwrite` starts over): tests/faults/test_run_again.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from actors.checkpoint import DataChanged, load_checkpoint, save_checkpoint
from actors.data.digest import job_data_digest
from actors.engine.adapter_surgery import remove_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.job_spec import JobSpec
from tests.helpers.data_files import change_one_row
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.service import job_dict, run_spec, write_task_data


def test_a_files_digest_follows_its_bytes_not_its_path_or_time(tmp_path):
    path = write_task_data(tmp_path, "task")
    digest = job_data_digest(path)
    assert digest.startswith("bytes:")
    write_task_data(tmp_path, "task")                      # the same rows written again: a new time, same bytes
    os.utime(path, ns=(1, 1))
    assert job_data_digest(path) == digest
    size = path.stat().st_size
    change_one_row(path)
    assert path.stat().st_size == size and len(path.read_text().splitlines()) == 32
    assert job_data_digest(path) != digest


def test_a_folders_digest_covers_the_files_of_its_split(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "parquet"
    folder.mkdir()
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "test-00000-of-00001.parquet")
    train, test = job_data_digest(folder, "train"), job_data_digest(folder, "test")
    pq.write_table(pa.Table.from_pylist(rows[:2] + [{"question": "q2", "answer": "changed"}]),
                   folder / "test-00000-of-00001.parquet")
    assert job_data_digest(folder, "train") == train       # another split's file: not this job's data
    assert job_data_digest(folder, "test") != test
    pq.write_table(pa.Table.from_pylist(rows[:5] + [{"question": "q5", "answer": "a6"}]),
                   folder / "train-00000-of-00001.parquet")
    assert job_data_digest(folder, "train") != train

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:3])}).save_to_disk(str(saved))
    train, test = job_data_digest(saved, "train"), job_data_digest(saved, "test")
    assert train != test and train.startswith("bytes:")
    changed = rows[:4] + [{"question": "q4", "answer": "b4"}, rows[5]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(changed),
                          "test": datasets.Dataset.from_list(rows[:3])}).save_to_disk(str(saved))
    assert job_data_digest(saved, "train") != train
    assert job_data_digest(saved, "test") == test


def _job(base, data: str = "data/task.jsonl", digest: str | None = None) -> TrainingJob:
    """A fresh job on `base` (the previous one's adapter taken off it), its data's digest `digest`."""
    remove_adapter(base.model, "digested")
    spec = JobSpec(name="digested", data=data, format={"type": "text"}, batch_size=2, max_steps=4, lr=1e-2,
                   lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    job = TrainingJob.create(spec, base, random_examples(0, count=8), [], seed=0)
    job.data_digest = digest
    return job


def test_a_checkpoint_keeps_its_data_digest_and_refuses_other_data(tmp_path):
    base = from_module(tiny_model(), None)
    trainer = FusedTrainer(base)
    job = _job(base, digest="bytes:0123")
    trainer.add_job(job)
    while job.step < 2:
        trainer.train_step()
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    trainer.remove_job(job.name)
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["data_digest"] == "bytes:0123"

    same = _job(base, digest="bytes:0123")
    loaded = load_checkpoint(same, tmp_path / "ckpt")
    assert loaded.step == 2 and loaded.notes == []
    torch.testing.assert_close(dict(same.adapter.named_parameters()), dict(job.adapter.named_parameters()),
                               rtol=0, atol=0)
    other = _job(base, digest="bytes:4567")
    with pytest.raises(DataChanged) as refused:
        load_checkpoint(other, tmp_path / "ckpt")
    message = str(refused.value)
    assert "job 'digested'" in message and "data/task.jsonl" in message and "--overwrite" in message
    assert "step 2" in message and "content differs" in message
    assert other.step == 0, "a refused checkpoint leaves the job untouched"
    unknown = _job(base, digest=None)           # a job whose data is not known (the engine alone): not checked
    assert load_checkpoint(unknown, tmp_path / "ckpt").notes == []

    del state["data_digest"]                    # as an older aspen wrote it
    (tmp_path / "ckpt" / "state.json").write_text(json.dumps(state))
    older = _job(base, digest="bytes:4567")
    loaded = load_checkpoint(older, tmp_path / "ckpt")
    assert loaded.step == 2 and len(loaded.notes) == 1
    assert "no digest" in loaded.notes[0] and "data/task.jsonl" in loaded.notes[0] and "could not be checked" in \
        loaded.notes[0]


def _assignment(submission, job_id: str, tokenizer) -> Assignment:
    data = JobData(job_id, submission, tokenizer)
    return Assignment(job_id=job_id, submission=submission, output_dir=Path(submission.output_dir),
                      data=data.prepare(), eval_examples=data.eval_examples(),
                      link=LocalJobLink(data))


def _run(loop: TrainerLoop) -> list:
    events = []
    for _ in range(500):
        loop.run_once(idle_wait=0)
        events += loop.drain_events()
        if not loop.active and not loop.leaving and loop.commands.empty():
            return events
    raise AssertionError("the trainer loop did not finish its jobs")


def test_a_job_the_service_resumes_on_changed_data_fails_and_on_the_same_data_resumes(tmp_path, tiny_base,
                                                                                      tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "resumable")
    original = data.read_bytes()
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                    [job_dict("resumable", data, 8, checkpoint_every=3)])
    (submission,) = spec.submissions()
    config = TrainerConfig(base_model=spec.base_model)
    loop = TrainerLoop(tiny_base, config, "trainer-t", tmp_path / "state")
    loop.assign(_assignment(submission, "resumable-1", tiny_base.tokenizer))
    for _ in range(4):
        loop.run_once(idle_wait=0)
    loop.stop_job("resumable-1", "paused", "preempted")
    assert [e.data["checkpoint_step"] for e in _run(loop) if e.kind == "paused"] == [4]

    change_one_row(data)                                   # the same path and row count, another row
    loop = TrainerLoop(tiny_base, config, "trainer-u", tmp_path / "state")   # a new trainer, a new job actor
    loop.assign(_assignment(submission, "resumable-1", tiny_base.tokenizer))
    (failed,) = [e for e in _run(loop) if e.kind == "failed"]
    reason = failed.data["reason"]
    assert "job 'resumable-1'" in reason and str(data) in reason and "--overwrite" in reason, reason
    assert json.loads((tmp_path / "out/resumable/checkpoint/state.json").read_text())["step"] == 4   # kept

    data.write_bytes(original)                             # the data it trained on, back
    loop.assign(_assignment(submission, "resumable-1", tiny_base.tokenizer))
    events = _run(loop)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == 4 and started.data["checkpoint_note"] == ""
    assert any(e.kind == "completed" for e in events)
    rows = [json.loads(r) for r in (tmp_path / "out/resumable/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
