"""Storage URIs against a real S3-compatible server (moto_server, tests/helpers/s3_server.py): checkpoints mirrored
with the pointer written last (a crash before it leaves the previous checkpoint readable), damaged objects
refused by name, errors that name the fix; a job whose output is an s3:// URI, stopped and its node-local
folder deleted, resumes on a fresh trainer to the adapter and generations of an undisturbed run; a job reads its dataset
from s3://; a service whose output root is a URI places and guards job folders there."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from rich.console import Console
from safetensors.torch import load as load_safetensors

from actors.data import DataError, read_rows
from actors.service.outputs.job_files import read_generations
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduler_core import SchedulerCore, SubmissionError
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.job_submission import JobSubmission
from actors.storage.checkpoint_mirror import POINTER_NAME, download_checkpoint, read_pointer, upload_checkpoint
from actors.storage.storage_errors import CorruptCheckpoint, StorageError, StorageUnreachable
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import StorageURI, as_location, resolve_location
from orchestrator.cli.run_commands import saved_step as _saved_step
from orchestrator.report import collect, write_report
from policies.fifo import FifoPolicy
from tests.helpers.ports import free_port
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle


def _raw_s3(server) -> pafs.S3FileSystem:
    """A filesystem on the server that bypasses aspen's storage module (to damage objects behind its back)."""
    return pafs.S3FileSystem(endpoint_override=server.endpoint.split("://", 1)[1], scheme="http",
                             access_key="testing", secret_key="testing", region="us-east-1", request_timeout=60)


def _checkpoint_like(folder: Path, marker: bytes) -> dict[str, bytes]:
    files = {"state.json": b'{"step": 1}\n' + marker, "optimizer.safetensors": marker * 1000,
             "adapter_model.safetensors": marker * 3000 + b"end", "adapter_config.json": b"{}"}
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _read_folder(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


# ---------------------------------------------------------------------------------------- the module


def test_checkpoints_round_trip_and_older_uploads_are_deleted(s3_bucket, tmp_path):
    location = StorageLocation(f"s3://{s3_bucket}/runs/job-a")
    first = _checkpoint_like(tmp_path / "ck3", b"three")
    upload_checkpoint(location, tmp_path / "ck3", 3)
    second = _checkpoint_like(tmp_path / "ck6", b"six")
    pointer = upload_checkpoint(location, tmp_path / "ck6", 6)
    assert first != second
    assert location.list("checkpoints") == [pointer["upload"].rsplit("/", 1)[1]], "the older upload stayed"
    # the pointer's sizes and hashes are those of the local files (computed here independently)
    for name, data in second.items():
        assert pointer["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert download_checkpoint(location, tmp_path / "fresh" / "checkpoint") == 6
    assert _read_folder(tmp_path / "fresh" / "checkpoint") == second


def test_a_crash_between_the_files_and_the_pointer_leaves_the_previous_checkpoint(s3_bucket, tmp_path, monkeypatch):
    location = StorageLocation(f"s3://{s3_bucket}/runs/job-b")
    first = _checkpoint_like(tmp_path / "ck3", b"three")
    upload_checkpoint(location, tmp_path / "ck3", 3)
    _checkpoint_like(tmp_path / "ck6", b"six")
    real_write = StorageLocation.write_bytes

    def dies_at_the_pointer(self, name, data):
        if name == POINTER_NAME:
            raise KeyboardInterrupt("the process died before writing the pointer")
        return real_write(self, name, data)

    monkeypatch.setattr(StorageLocation, "write_bytes", dies_at_the_pointer)
    with pytest.raises(KeyboardInterrupt):
        upload_checkpoint(location, tmp_path / "ck6", 6)
    monkeypatch.undo()
    assert len(location.list("checkpoints")) == 2, "step 6's files were uploaded before the crash"
    assert read_pointer(location)["step"] == 3
    assert download_checkpoint(location, tmp_path / "node2" / "checkpoint") == 3
    assert _read_folder(tmp_path / "node2" / "checkpoint") == first
    # the next complete upload moves the pointer and deletes both older uploads
    upload_checkpoint(location, tmp_path / "ck6", 7)
    assert len(location.list("checkpoints")) == 1 and read_pointer(location)["step"] == 7


def test_a_damaged_object_is_refused_by_name_and_the_local_folder_kept(s3_server, s3_bucket, tmp_path):
    location = StorageLocation(f"s3://{s3_bucket}/runs/job-c")
    _checkpoint_like(tmp_path / "ck", b"x")
    pointer = upload_checkpoint(location, tmp_path / "ck", 4)
    local = tmp_path / "node" / "checkpoint"
    before = _checkpoint_like(local, b"local")
    key = f"{s3_bucket}/runs/job-c/{pointer['upload']}/optimizer.safetensors"
    with _raw_s3(s3_server).open_output_stream(key) as stream:
        stream.write(b"y" * 1000)   # same size, other bytes
    with pytest.raises(CorruptCheckpoint) as caught:
        download_checkpoint(location, local)
    assert f"s3://{s3_bucket}/runs/job-c/{pointer['upload']}/optimizer.safetensors" in str(caught.value)
    assert "sha256" in str(caught.value)
    assert _read_folder(local) == before, "a refused download touched the local checkpoint"
    with _raw_s3(s3_server).open_output_stream(f"{s3_bucket}/runs/job-c/{POINTER_NAME}") as stream:
        stream.write(b'{"step": 4, "upl')   # a truncated pointer
    with pytest.raises(CorruptCheckpoint, match="not a checkpoint pointer"):
        read_pointer(location)


def test_errors_name_the_uri_and_the_fix(s3_server, monkeypatch):
    with pytest.raises(StorageError) as caught:
        StorageLocation("s3://no-such-bucket-aspen/prefix").check_writable()
    assert "s3://no-such-bucket-aspen/prefix" in str(caught.value) and "bucket does not exist" in str(caught.value)
    with pytest.raises(StorageError, match="not found"):
        StorageLocation(f"s3://{s3_server.make_bucket()}").read_bytes("nothing.jsonl")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    with pytest.raises(StorageError) as caught:
        StorageLocation("s3://bucket/prefix").check_writable()
    assert "cannot be reached" in str(caught.value) and "AWS_ENDPOINT_URL_S3" in str(caught.value)
    assert isinstance(caught.value, StorageUnreachable)   # transient: a job whose data it is starts again
    with pytest.raises(StorageUnreachable, match="the dataset s3://bucket/data.jsonl: reading failed"):
        read_rows("s3://bucket/data.jsonl")   # not a DataError: nothing is wrong with the data


def test_a_file_uri_works_like_a_bucket(tmp_path):
    location = StorageLocation((tmp_path / "shared").as_uri())
    files = _checkpoint_like(tmp_path / "ck", b"f")
    upload_checkpoint(location, tmp_path / "ck", 2)
    assert json.loads((tmp_path / "shared" / POINTER_NAME).read_text())["step"] == 2
    assert download_checkpoint(location, tmp_path / "back" / "checkpoint") == 2
    assert _read_folder(tmp_path / "back" / "checkpoint") == files
    assert StorageURI("s3://b/p") / "job" == "s3://b/p/job"
    assert as_location(Path("s3://b/p/job")) == "s3://b/p/job", "a URI mangled by Path() is not given back"
    assert resolve_location("runs/x") == Path.cwd() / "runs/x" and resolve_location("gs://b/x/") == "gs://b/x"


# ------------------------------------------------------------------------------------ whole jobs


def _s3_adapter(location: StorageLocation) -> dict[str, torch.Tensor]:
    return load_safetensors(location.read_bytes("adapter_model.safetensors"))


def test_a_job_on_s3_stopped_and_its_node_folder_lost_resumes_to_the_undisturbed_adapter(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    scored = {"eval_split": 4, "eval_every": 2, "eval_generate": {"metric": "contains", "max_new_tokens": 3}}
    job = job_dict("mirrored", write_task_data(tmp_path / "data", "mirrored"), 6, checkpoint_every=2, **scored)
    uri = f"s3://{s3_bucket}/runs"
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), uri, [job]).submissions()
    assert submission.output_dir == f"{uri}/mirrored"
    config = TrainerConfig(base_model=submission.base_model)
    node_a = tmp_path / "node-a"
    loop = TrainerLoop(tiny_base, config, "trainer-a", node_a)
    loop.assign(assignment_for(submission, "mirrored-1", tiny_base.tokenizer))
    for _ in range(3):
        loop.run_once(idle_wait=0)
    loop.stop_job("mirrored-1", "paused", "test")
    events = run_until_idle(loop)
    assert [e.step for e in events if e.kind == "checkpoint"] == [2]
    paused = next(e for e in events if e.kind == "paused")
    assert paused.data["checkpoint_step"] == 3
    location = StorageLocation(f"{uri}/mirrored")
    assert read_pointer(location)["step"] == 3
    assert [json.loads(r)["step"] for r in location.read_bytes("metrics.jsonl").decode().splitlines()] == [1, 2, 3]
    assert not location.exists("adapter_model.safetensors"), "a paused job uploaded an adapter"
    assert read_generations(location.uri)["steps"] == [2]   # its evaluations so far, with its checkpoint
    assert _saved_step(f"{uri}/mirrored") == 3   # what `aspen run` tells before resuming
    shutil.rmtree(node_a)   # the node is gone with its staging folder

    loop2 = TrainerLoop(tiny_base, config, "trainer-b", tmp_path / "node-b")
    loop2.assign(assignment_for(submission, "mirrored-1", tiny_base.tokenizer))
    events = run_until_idle(loop2)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == 3
    completed = next(e for e in events if e.kind == "completed")
    assert completed.data["adapter_dir"] == f"{uri}/mirrored"
    assert read_pointer(location)["step"] == 6

    # the reference: the same job undisturbed, written to a local folder (by the now idle second trainer)
    local = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "local", [job])
    (local_submission,) = local.submissions()
    loop2.assign(assignment_for(local_submission, "mirrored-1", tiny_base.tokenizer))
    events = run_until_idle(loop2)
    assert next(e for e in events if e.kind == "started").data["resumed_from"] is None
    reference = adapter_tensors(tmp_path / "local" / "mirrored")
    resumed = _s3_adapter(location)
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[key], resumed[key]) for key in reference)
    rows = [json.loads(r) for r in location.read_bytes("metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    # its generations: every evaluation's once, those before the move too, as the undisturbed job wrote them
    moved, undisturbed = read_generations(location.uri), read_generations(tmp_path / "local" / "mirrored")
    assert moved["steps"] == undisturbed["steps"] == [2, 4, 6]
    for step in (2, 4):
        assert read_generations(location.uri, step) == read_generations(tmp_path / "local" / "mirrored", step)
    assert moved == undisturbed


def test_a_dpo_job_on_s3_resumes_on_another_node_with_its_checkpoints_reference_copy(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    """A dpo job from a saved adapter, writing to S3: paused, its node folder and the saved adapter both gone, it
    resumes on another node with the reference adapter its uploaded checkpoint holds, and completes."""
    from tests.helpers.pairs import ROWS
    from tests.helpers.peft_adapters import saved_peft_lora

    targets = ["q_proj", "v_proj"]
    saved = saved_peft_lora(str(tiny_model_dirs["llama"]), tmp_path / "saved", targets, seed=2)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    job = job_dict("dpo", pairs, 4, method="dpo", batch_size=2, format={"type": "preference"}, checkpoint_every=2,
                   init_adapter=str(saved), lora={"r": 4, "alpha": 8, "target_modules": targets})
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), f"s3://{s3_bucket}/runs", [job]).submissions()
    config = TrainerConfig(base_model=submission.base_model)
    loop = TrainerLoop(tiny_base, config, "trainer-a", tmp_path / "node-a")
    loop.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    for _ in range(3):
        loop.run_once(idle_wait=0)
    loop.stop_job("dpo-1", "paused", "test")
    assert any(e.kind == "paused" for e in run_until_idle(loop))
    pointer = read_pointer(StorageLocation(f"s3://{s3_bucket}/runs/dpo"))
    assert "reference_model.safetensors" in pointer["files"], pointer["files"]
    shutil.rmtree(tmp_path / "node-a")
    shutil.rmtree(saved)
    again = TrainerLoop(tiny_base, config, "trainer-b", tmp_path / "node-b")
    again.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    events = run_until_idle(again)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == pointer["step"]
    assert started.data["checkpoint_note"].endswith(f"its reference is its checkpoint's copy of {saved}")
    assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]


def test_a_failed_upload_keeps_the_job_and_the_next_checkpoint_uploads_again(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs, monkeypatch):
    job = job_dict("flaky", write_task_data(tmp_path / "data", "flaky"), 4, checkpoint_every=2)
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), f"s3://{s3_bucket}/runs", [job]).submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=submission.base_model), "trainer-a", tmp_path / "node")
    loop.assign(assignment_for(submission, "flaky-1", tiny_base.tokenizer))
    real_write = StorageLocation.write_bytes
    refused = []

    def step_4_refused(self, name, data):
        if name.startswith("checkpoints/000000002"):
            refused.append(name)
            raise StorageError(f"{self.uri}/{name}: writing failed: permission denied (a test)")
        return real_write(self, name, data)

    monkeypatch.setattr(StorageLocation, "write_bytes", step_4_refused)
    events = run_until_idle(loop)
    checkpoints = [(e.step, e.data) for e in events if e.kind == "checkpoint"]
    assert [step for step, _ in checkpoints] == [2]
    assert "uploaded again at the next checkpoint" in checkpoints[0][1]["upload_error"]
    assert refused
    assert any(e.kind == "completed" for e in events), [e.data.get("reason") for e in events if e.kind != "step"]
    assert read_pointer(StorageLocation(f"s3://{s3_bucket}/runs/flaky"))["step"] == 4


def test_a_job_reads_its_dataset_from_s3(s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    """Through `train_locally` (`aspen run --in-process`): data and output both on S3, against the same job
    with both on disk; an earlier run's leftovers under the URI are cleared first, as in a folder."""
    data = write_task_data(tmp_path / "data", "remote")
    StorageLocation(f"s3://{s3_bucket}/datasets").upload_file(data, "remote.jsonl")
    output = StorageLocation(f"s3://{s3_bucket}/out")
    output.write_bytes("remote/checkpoint.json", b"left by an earlier run")
    steps = 3
    scored = {"eval_split": 4, "eval_every": steps, "eval_generate": {"metric": "contains", "max_new_tokens": 3}}
    on_s3 = run_spec(str(tiny_model_dirs["llama"]), output.uri,
                     [job_dict("remote", f"s3://{s3_bucket}/datasets/remote.jsonl", steps, **scored)])
    on_disk = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "local-data",
                       [job_dict("remote", data, steps, **scored)])
    (from_s3,) = train_locally(on_s3, base=tiny_base, progress=False)
    (from_disk,) = train_locally(on_disk, base=tiny_base, progress=False)
    assert from_s3.state == "completed" and from_s3.steps == steps, from_s3.reason
    assert from_s3.adapter_dir == f"{output.uri}/remote"
    assert read_pointer(output.child("remote"))["step"] == steps
    a, b = _s3_adapter(output.child("remote")), adapter_tensors(tmp_path / "local-data" / "remote")
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    # its generations are uploaded with its results, and read from the URI as from the folder
    from_uri = read_generations(f"{output.uri}/remote")
    assert from_uri["steps"] == [steps] and len(from_uri["rows"]) == 4
    assert from_uri == read_generations(tmp_path / "local-data" / "remote")
    # the report reads the metrics from the URI and uploads its files there
    (metrics,) = collect(output.uri)
    local_lines = (tmp_path / "local-data" / "remote" / "metrics.jsonl").read_text().splitlines()
    local_rows = [json.loads(r) for r in local_lines]
    assert metrics.losses == [row["loss"] for row in local_rows]
    write_report(output.uri, console=Console(file=io.StringIO()))
    assert output.read_bytes("report.png").startswith(b"\x89PNG")
    with pytest.raises(DataError, match=f"s3://{s3_bucket}/datasets/gone.jsonl: not found"):
        read_rows(f"s3://{s3_bucket}/datasets/gone.jsonl")


def test_an_output_root_uri_places_and_guards_job_folders(s3_bucket, tmp_path, tiny_model_dirs):
    root = f"s3://{s3_bucket}/service"
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state", output_root=root)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "ignored",
                    [job_dict("a", tmp_path / "a.jsonl", 2), job_dict("b", tmp_path / "b.jsonl", 2)])
    a, b = spec.submissions()
    unnamed = a.model_copy(update={"output_dir": None})
    assert core.submit(unnamed).output_dir == f"{root}/{core.table.all()[0].id}"
    relative = JobSubmission.model_validate({**b.model_dump(mode="json"), "output_dir": "team/b"})
    assert core.submit(relative).output_dir == f"{root}/team/b"
    with pytest.raises(SubmissionError, match="already writes to"):
        core.submit(JobSubmission.model_validate({**b.model_dump(mode="json"), "output_dir": f"{root}/team/b"}))
    with pytest.raises(SubmissionError, match="outside this service's output root"):
        core.submit(JobSubmission.model_validate({**b.model_dump(mode="json"), "output_dir": f"s3://{s3_bucket}/x"}))
    with pytest.raises(SubmissionError, match="a path on this machine"):
        core.submit(JobSubmission.model_validate({**b.model_dump(mode="json"), "output_dir": str(tmp_path / "b")}))


def test_a_job_whose_uploads_all_fail_fails_with_the_uri_and_resumes_from_its_node_copy(
        s3_bucket, tmp_path, tiny_base, tiny_model_dirs, monkeypatch):
    job = job_dict("offline", write_task_data(tmp_path / "data", "offline"), 4, checkpoint_every=2)
    uri = f"s3://{s3_bucket}/runs"
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), uri, [job]).submissions()
    config = TrainerConfig(base_model=submission.base_model)
    real_write = StorageLocation.write_bytes

    def refused(self, name, data):
        if not name.startswith(".aspen-write-check"):   # the store took the job, then went away
            raise StorageError(f"{self.uri}/{name}: writing failed: the storage endpoint cannot be reached (a test)")
        return real_write(self, name, data)

    monkeypatch.setattr(StorageLocation, "write_bytes", refused)
    loop = TrainerLoop(tiny_base, config, "trainer-a", tmp_path / "node")
    loop.assign(assignment_for(submission, "offline-1", tiny_base.tokenizer))
    events = run_until_idle(loop)
    failed = next(e for e in events if e.kind == "failed")
    assert f"{uri}/offline" in failed.data["reason"] and "cannot be reached" in failed.data["reason"]
    assert read_pointer(StorageLocation(f"{uri}/offline")) is None
    monkeypatch.undo()
    # the store is back: the same node resumes from the checkpoint only it holds, and uploads everything
    loop2 = TrainerLoop(tiny_base, config, "trainer-a2", tmp_path / "node")
    loop2.assign(assignment_for(submission, "offline-1", tiny_base.tokenizer))
    events = run_until_idle(loop2)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == 4 and "none was uploaded" in started.data["checkpoint_note"]
    assert any(e.kind == "completed" for e in events)
    location = StorageLocation(f"{uri}/offline")
    assert read_pointer(location)["step"] == 4
    local = adapter_tensors(tmp_path / "node" / "staging" / "offline-1")
    remote = _s3_adapter(location)
    assert all(torch.equal(local[key], remote[key]) for key in local)


def test_a_saved_adapter_is_read_from_a_storage_uri(s3_server, tiny_base, tmp_path, monkeypatch):
    """`init_adapter: s3://...`: the adapter's two objects read from a real S3 server give the job the weights the
    local folder gives; a missing one is named with what to do; an endpoint that does not answer is transient
    (StorageUnreachable: the job's start is tried again), not the adapter's fault."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from actors.checkpoint.initial_adapter import start_from_adapter
    from actors.checkpoint.peft_io import adapter_state_dict
    from actors.engine.job import TrainingJob
    from actors.spec.saved_adapter import AdapterFileError
    from tests.helpers.fused import job_spec
    from tests.helpers.models import random_examples

    peft_model = get_peft_model(tiny_base.model.__class__(tiny_base.model.config),
                                PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    peft_model.save_pretrained(tmp_path / "adapter")
    bucket = s3_server.make_bucket()
    StorageLocation(f"s3://{bucket}/adapters/sft").upload_folder(tmp_path / "adapter")
    spec = job_spec("remote", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    examples = random_examples(1, count=4)
    remote = TrainingJob.create(spec, tiny_base, examples, [], seed=0)
    assert start_from_adapter(remote.adapter, f"s3://{bucket}/adapters/sft") == \
        f"its adapter started from s3://{bucket}/adapters/sft"
    local = TrainingJob.create(spec.model_copy(update={"name": "local"}), tiny_base, examples, [], seed=0)
    start_from_adapter(local.adapter, tmp_path / "adapter")
    remote_weights, local_weights = adapter_state_dict(remote.adapter), adapter_state_dict(local.adapter)
    assert all(torch.equal(remote_weights[key], local_weights[key]) for key in local_weights)
    assert any(float(value.abs().max()) > 0 for key, value in local_weights.items() if "lora_B" in key)
    with pytest.raises(AdapterFileError, match=rf"s3://{bucket}/adapters/none/adapter_config.json does not exist"):
        start_from_adapter(remote.adapter, f"s3://{bucket}/adapters/none")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    with pytest.raises(StorageUnreachable, match=rf"init_adapter: s3://{bucket}/adapters/sft/adapter_config.json"):
        start_from_adapter(remote.adapter, f"s3://{bucket}/adapters/sft")
