"""Checkpoint uploads off the training thread, against a real S3-compatible server (moto_server, stopped with
SIGSTOP for a while: its port still takes connections, no request is answered, as a blackholed store): the
trainer keeps stepping its jobs while a job's upload hangs, the newest checkpoint is uploaded after the one in
flight, and the adapters equal an undisturbed run's; a job that leaves while its upload hangs is reported
ended only once everything it leaves is on S3, and another node resumes it from there to the adapter of an
undisturbed run (a job assigned again meanwhile starts after that, from its uploaded checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.storage.checkpoint_mirror import download_checkpoint, read_pointer
from actors.storage.storage_location import StorageLocation
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle

SAFETY_S = 60.0   # the server is let go after this long whatever happens (a trainer that waits for it then fails)


@contextmanager
def server_stopped(server) -> Iterator[dict]:
    """The S3 server frozen (SIGSTOP) until the block ends, or SAFETY_S at most; yields {"stopped", "resumed"}
    (monotonic times; "resumed" is set by the safety timer if it fired first)."""
    times: dict[str, float] = {}
    resumed = threading.Lock()

    def resume(by_safety: bool) -> None:
        with resumed:
            if "resumed" not in times:
                os.kill(server.pid, signal.SIGCONT)
                times["resumed"] = time.monotonic()
                times["by_safety"] = by_safety

    safety = threading.Timer(SAFETY_S, resume, args=(True,))
    os.kill(server.pid, signal.SIGSTOP)
    times["stopped"] = time.monotonic()
    safety.start()
    try:
        yield times
    finally:
        resume(False)
        safety.cancel()


def _s3_adapter(location: StorageLocation) -> dict[str, torch.Tensor]:
    return load_safetensors(location.read_bytes("adapter_model.safetensors"))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _remote_and_local(bucket: str, tmp_path: Path, tiny_base, base: str, remote_name: str, local_name: str,
                      local_steps: int, node: str) -> tuple[TrainerLoop, str, dict, dict]:
    """A trainer loop holding two jobs of 6 and `local_steps` steps: one writing to S3 (a checkpoint every 2
    steps), one to a local folder; (the loop, the URI, the two job dicts)."""
    data = tmp_path / "data"
    remote_job = job_dict(remote_name, write_task_data(data, remote_name), 6, checkpoint_every=2)
    local_job = job_dict(local_name, write_task_data(data, local_name, offset=3), local_steps)
    uri = f"s3://{bucket}/runs"
    (remote,) = run_spec(base, uri, [remote_job]).submissions()
    (local,) = run_spec(base, tmp_path / "out", [local_job]).submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=base), "trainer-a", tmp_path / node)
    loop.assign([assignment_for(remote, f"{remote_name}-1", tiny_base.tokenizer),
                 assignment_for(local, f"{local_name}-1", tiny_base.tokenizer)])
    return loop, uri, remote_job, local_job


def test_steps_go_on_while_an_upload_hangs_and_the_adapters_equal_an_undisturbed_run(
        s3_server, s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    loop, uri, remote_job, local_job = _remote_and_local(s3_bucket, tmp_path, tiny_base, base, "remote", "local", 6,
                                                         "node")
    assert loop.run_once(idle_wait=0) is not None   # step 1 (the jobs started, their URI checked, before the stall)
    during = []
    with server_stopped(s3_server) as stall:
        for _ in range(3):   # step 2 checkpoints "remote" (its upload hangs), steps 3 and 4 run meanwhile
            report = loop.run_once(idle_wait=0)
            assert report is not None and {r.job for r in report.results} == {"remote-1", "local-1"}
            during.append(loop.outputs.uploads.pending("remote-1"))
        hanging = loop.active["remote-1"].mirror.upload
        assert hanging is not None and not hanging.done(), "the upload did not hang: the server was not stopped?"
    assert not stall["by_safety"], "the trainer waited for the stopped server (its uploads ran on its thread)"
    assert during == [True, True, True]
    rows = [json.loads(line) for line in loop.step_log.path.read_text().splitlines()]
    in_stall = [r["step"] for r in rows if stall["stopped"] - time.monotonic() + time.time() <= r["time"]]
    assert len(in_stall) >= 3, rows   # (wall-clock times of the step log: steps 2-4 ran after the stop)
    hanging.exception(timeout=SAFETY_S)   # the server answers again: the hanging upload ends
    events = run_until_idle(loop)
    checkpoints = [(e.step, e.data) for e in events if e.kind == "checkpoint" and e.job_id == "remote-1"]
    # the hanging step-2 upload ended once the server answered; step 4's, taken meanwhile, went after it
    assert [step for step, _ in checkpoints] == [2, 4], checkpoints
    assert all(data.get("uploaded") == f"{uri}/remote" for _, data in checkpoints), checkpoints
    completed = {e.job_id: e for e in events if e.kind == "completed"}
    assert set(completed) == {"remote-1", "local-1"}
    assert completed["remote-1"].data["adapter_dir"] == f"{uri}/remote"
    location = StorageLocation(f"{uri}/remote")
    assert read_pointer(location)["step"] == 6
    assert download_checkpoint(location, tmp_path / "elsewhere" / "checkpoint") == 6   # complete, hashes checked
    assert _equal(load_safetensors((tmp_path / "elsewhere" / "checkpoint" / "adapter_model.safetensors").read_bytes()),
                  _s3_adapter(location))

    # the reference: the same two jobs, both on disk, undisturbed (by the now idle trainer)
    (ref_remote,) = run_spec(base, tmp_path / "ref", [remote_job]).submissions()
    (ref_local,) = run_spec(base, tmp_path / "ref", [local_job]).submissions()
    loop.assign([assignment_for(ref_remote, "ref-remote", tiny_base.tokenizer),
                 assignment_for(ref_local, "ref-local", tiny_base.tokenizer)])
    run_until_idle(loop)
    loop.close()
    assert _equal(_s3_adapter(location), adapter_tensors(tmp_path / "ref" / "remote"))
    assert _equal(adapter_tensors(tmp_path / "out" / "local"), adapter_tensors(tmp_path / "ref" / "local"))


def test_a_job_leaving_while_its_upload_hangs_is_reported_once_all_is_uploaded_and_restarts_after(
        s3_server, s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    loop, uri, leaving_job, _ = _remote_and_local(s3_bucket, tmp_path, tiny_base, base, "leaving", "other", 8, "node-a")
    (leaving,) = run_spec(base, uri, [leaving_job]).submissions()
    loop.run_once(idle_wait=0)
    location = StorageLocation(f"{uri}/leaving")
    with server_stopped(s3_server) as stall:
        loop.run_once(idle_wait=0)                       # step 2: its checkpoint's upload hangs
        loop.run_once(idle_wait=0)                       # step 3
        loop.drain_events()
        loop.stop_job("leaving-1", "paused", "moved by the test")
        loop.assign(assignment_for(leaving, "leaving-1", tiny_base.tokenizer))   # back at once: it waits
        steps_after = []
        for _ in range(3):                               # it leaves; the other job goes on stepping
            report = loop.run_once(idle_wait=0)
            assert report is not None
            steps_after.append({r.job for r in report.results})
        events = loop.drain_events()
        assert not [e for e in events if e.job_id == "leaving-1" and e.kind in ("paused", "failed", "started")], events
        assert "leaving-1" in loop.leaving and "leaving-1" in loop.status().jobs
    assert not stall["by_safety"]
    assert steps_after == [{"other-1"}] * 3
    ended = None
    for _ in range(400):
        loop.run_once(idle_wait=0.05)
        events = [e for e in loop.drain_events() if e.job_id == "leaving-1"]
        ended = next((e for e in events if e.kind in ("paused", "failed")), None)
        if ended is not None:
            lifecycle = [e for e in events if e.kind in ("paused", "failed", "started")]
            assert [e.kind for e in lifecycle] == [ended.kind, "started"], events   # started again after it ended
            assert lifecycle[1].data["resumed_from"] == 3
            # what is on S3 once its end is reported: its checkpoint at step 3 and all 3 metric rows. (The job,
            # started again in the same tick, may already have trained step 4 and uploaded its checkpoint:
            # never before the leaving upload ended, which is what a later pointer or row would show.)
            assert ended.kind == "paused" and ended.data["checkpoint_step"] == 3, ended
            assert read_pointer(location)["step"] in (3, 4)
            metric_steps = [json.loads(r)["step"] for r in location.read_bytes("metrics.jsonl").decode().splitlines()]
            assert metric_steps in ([1, 2, 3], [1, 2, 3, 4]), metric_steps
            break
    assert ended is not None, "the leaving job was never reported"
    events = run_until_idle(loop)
    assert next(e for e in events if e.job_id == "leaving-1" and e.kind == "completed").data["adapter_dir"] == \
        f"{uri}/leaving"
    (reference,) = run_spec(base, tmp_path / "ref", [leaving_job]).submissions()
    loop.assign(assignment_for(reference, "ref-1", tiny_base.tokenizer))
    run_until_idle(loop)
    loop.close()
    assert _equal(_s3_adapter(location), adapter_tensors(tmp_path / "ref" / "leaving"))


def test_a_final_upload_that_does_not_end_in_time_fails_the_job_and_moves_no_pointer_later(
        s3_server, s3_bucket, tmp_path, tiny_base, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    uri = f"s3://{s3_bucket}/runs"
    (stuck,) = run_spec(base, uri, [job_dict("stuck", write_task_data(tmp_path / "data", "stuck"), 2)]).submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=base, upload_timeout_s=1.0), "trainer-a", tmp_path / "node")
    loop.assign(assignment_for(stuck, "stuck-1", tiny_base.tokenizer))
    loop.run_once(idle_wait=0)
    with server_stopped(s3_server) as stall:
        loop.run_once(idle_wait=0)                 # its last step: it completes, its results' upload hangs
        left = time.monotonic()
        failed = None
        while failed is None and time.monotonic() - left < 20:
            loop.run_once(idle_wait=0.05)
            failed = next((e for e in loop.drain_events() if e.kind in ("failed", "completed")), None)
        waited = time.monotonic() - left
        upload_running = loop.outputs.uploads.pending("stuck-1")
    assert not stall["by_safety"]
    assert failed is not None and failed.kind == "failed", failed
    assert 1.0 <= waited < 10, waited
    assert f"{uri}/stuck" in failed.data["reason"] and "upload_timeout_s" in failed.data["reason"], failed.data
    assert "kept on trainer-a" in failed.data["reason"]
    assert upload_running, "the upload had ended before the server was let go"
    deadline = time.monotonic() + SAFETY_S
    while loop.outputs.uploads.pending("stuck-1") and time.monotonic() < deadline:   # the server answers: it ends
        time.sleep(0.1)
    assert not loop.outputs.uploads.pending("stuck-1")
    assert read_pointer(StorageLocation(f"{uri}/stuck")) is None, "an abandoned upload moved the pointer"
    loop.close()
