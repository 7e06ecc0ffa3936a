"""The job table's own disk refuses writes, on a real Ray, real SQLite and a real (tmpfs) file system: while
the state folder's disk is full a submission is refused with the cause and the fix (not taken for a lock
another process holds), `info()["table_error"]` says the same, the running job's events wait, and once the
disk takes writes again every step the job trained is in the table, in order."""

from __future__ import annotations

import json
import re

import pytest

from orchestrator.client import Client
from orchestrator.errors import ServiceError
from tests.helpers.disks import fill
from tests.helpers.service import job_dict, run_spec, service_config, wait_for, write_task_data


@pytest.mark.long
def test_a_full_table_disk_refuses_submissions_saying_so_and_loses_no_step(
        ray_session, tiny_model_dirs, tmp_path, small_disks):
    base = tiny_model_dirs["llama"]
    state = small_disks(tmp_path / "state", "8m")
    data, out = tmp_path / "data", tmp_path / "out"
    client = Client.local(service_config(state, base))

    def submit(name: str):
        return client.submit_run(run_spec(str(base), out, [job_dict(name, write_task_data(data, name), 3)],
                                          step_tokens=512))

    try:
        (running,) = client.submit_run(run_spec(str(base), out, [job_dict("long", write_task_data(data, "long"),
                                                                          100_000)], step_tokens=512))
        wait_for(lambda: running.status().step >= 2, what="the job to train")
        fill(state)                                      # the table's disk fills up mid-run
        with pytest.raises(ServiceError) as refused:
            submit("refused-full")
        message = str(refused.value)
        assert "database or disk is full" in message and f"the disk of {state} is full: free space there" in message
        assert "another process holds it" not in message, message
        wait_for(lambda: "is full" in client.info().get("table_error", ""), timeout=30,
                 what="info() to say why the trainer events wait")
        (state / "filler").unlink()
        wait_for(lambda: "table_error" not in client.info(), timeout=60, what="the waiting events to be booked")

        (after,) = submit("after")
        assert after.wait(timeout=120).state == "completed"
        assert [job.name for job in client.jobs()] == ["long", "after"]   # nothing refused was taken
        client.cancel(running.id)
        ended = running.wait(timeout=60)
        assert ended.state == "cancelled"
        # every step the trainer wrote to the job's own log is in the table, once and in order
        written = [json.loads(line)["step"] for line in (out / "long" / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in running.losses()] == written == list(range(1, ended.step + 1))
    finally:
        client.shutdown()


@pytest.mark.long
def test_a_service_stopped_on_a_full_table_disk_says_which_events_it_lost_and_its_jobs_resume(
        ray_session, tiny_model_dirs, tmp_path, small_disks):
    """Stopped while the table's disk is full, the service can neither book its trainers' last events nor write
    them beside the table: it says so (how many, which file, why) once everything else is stopped, and the next
    service on that folder, the disk freed, still has every job it acknowledged and resumes the running one."""
    base = tiny_model_dirs["llama"]
    state = small_disks(tmp_path / "state", "8m")
    data, out = tmp_path / "data", tmp_path / "out"
    config = service_config(state, base)
    client = Client.local(config)
    stopped = False
    try:
        long, short = client.submit_run(run_spec(str(base), out, [
            job_dict("long", write_task_data(data, "long"), 100_000, checkpoint_every=2),
            job_dict("short", write_task_data(data, "short", offset=1), 3)], step_tokens=512))
        assert short.wait(timeout=120).state == "completed"
        wait_for(lambda: long.status().checkpoint_step, what="the long job's first checkpoint")
        fill(state)
        with pytest.raises(ServiceError) as lost:
            stopped = True
            client.shutdown()
        message = str(lost.value)
        assert re.search(rf"\d+ trainer events the job table {state / 'jobs.sqlite'} did not take \(.*the disk of "
                         rf"{state} is full.*\) could not be written to {state / 'unapplied-events.jsonl'} either "
                         r"\(\[Errno 28\] No space left on device\): they are lost", message), message
        assert "resume from the last checkpoint the table has" in message
    finally:
        if not stopped:
            client.shutdown()
    (state / "filler").unlink()
    again = Client.local(config)
    try:
        jobs = {job.name: job for job in again.jobs()}
        assert set(jobs) == {"long", "short"} and jobs["short"].state == "completed", jobs
        wait_for(lambda: again.status(long.id).state == "running" and again.status(long.id).step
                 > jobs["long"].checkpoint_step, timeout=120, what="the long job to resume and train on")
        again.cancel(long.id)
    finally:
        again.shutdown()
