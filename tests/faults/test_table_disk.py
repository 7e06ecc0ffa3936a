"""The job table's own disk refuses writes, on a real Ray, real SQLite and a real (tmpfs) file system: while
the state folder's disk is full a submission is refused with the cause and the fix (not taken for a lock
another process holds), `info()["table_error"]` says the same, the running job's events wait, and once the
disk takes writes again every step the job trained is in the table, in order."""

from __future__ import annotations

import json

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
