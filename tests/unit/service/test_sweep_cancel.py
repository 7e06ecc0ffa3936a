"""Cancelling a sweep whose searcher raises (docs/sweeps.md, "Cancelling"), over the real scheduler core and job table.
Before, `SweepBook.cancel` told the searcher that the trials still pending ended cancelled, and a searcher that raised
there made the cancel itself fail (HTTP 500, `aspen sweep cancel` exit 1): the sweep ran on and could not be got rid
of. Now a cancel always ends the sweep: the searcher's error is logged and said in the answer (`problems`), the pending
trial ends cancelled, the running trial's job is cancelled, the sweep ends `cancelled` and its state file says so (a
service started again on it holds it cancelled)."""

from __future__ import annotations

import json

from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.spec.sweep_spec import SweepSpec
from tests.helpers.service import alice_with_quotas, job_dict


def test_a_cancel_ends_the_sweep_though_its_searcher_raises_at_its_pending_trials_end(tmp_path):
    core, table, users, data, state = alice_with_quotas(tmp_path, {"queued": 1}, policy="fifo")
    cancelled_jobs = []

    def cancel(job_id: str, reason: str) -> None:   # as the service does: the queued job ends at once
        cancelled_jobs.append(job_id)
        core.cancel(job_id, reason)

    book = SweepBook(state, SchedulerJobs(core, table, cancel=cancel))
    spec = SweepSpec(name="broken", output_dir=str(state / "outputs" / "alice" / "broken"), user="alice",
                     search="tests.helpers.searchers:FailsAtEveryWord", trials=2, max_concurrent=2,
                     job=job_dict("qa", data, 8, eval_split=4, eval_every=2), space={"lr": {"choice": [1e-3, 1e-2]}})
    book.add(spec)
    book.poll_all()   # her quota holds the second trial pending: cancelling it tells the searcher it ended
    assert [(t["name"], t["state"]) for t in book.status("broken")["trials"]] == [("qa-t0", "running"),
                                                                                  ("qa-t1", "pending")]

    answer = book.cancel("broken")
    assert any("on_complete raised RuntimeError: planted searcher failure at qa-t1's end" in problem
               for problem in answer["problems"]), answer
    (first,) = [r for r in table.all() if r.name == "qa-t0"]
    assert cancelled_jobs == [first.id] and table.get(first.id).state == "cancelled"
    book.poll_all()   # its job seen ended: the searcher, told again, raises again; the sweep ends all the same
    status = book.status("broken")
    assert status["state"] == "cancelled" and status["error"] is None
    assert [(t["name"], t["state"]) for t in status["trials"]] == [("qa-t0", "cancelled"), ("qa-t1", "cancelled")]
    stored = json.loads((state / "sweeps" / "broken.json").read_text())
    assert stored["driver"]["cancelled"] and "failed" not in stored
    assert SweepBook(state, SchedulerJobs(core, table, cancel=cancel)).status("broken")["state"] == "cancelled"
    table.close()
