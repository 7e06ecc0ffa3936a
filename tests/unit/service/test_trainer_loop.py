"""The Ray-free cores of the service, in-process: a trainer loop fed by job data over links equals a
solo run of each job, jobs join a running loop, stop rules end jobs early, and the scheduler core keeps
its table through a restart."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduler_core import SchedulerCore, SubmissionConflict
from actors.service.table.job_table import JobTable
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.stop_verdicts import VERDICT_LAG
from actors.service.trainer.trainer_loop import TrainerLoop
from policies.base import Start, Wait
from policies.fifo import FifoPolicy
from tests.helpers.service import adapter_tensors, job_dict, max_relative_difference, run_spec, write_task_data
from tests.helpers.trainer import LateVerdicts, assignment_for, fake_status, run_until_idle


def test_jobs_joining_a_running_loop_end_like_solo_runs(tmp_path, tiny_base, tiny_model_dirs):
    data = tmp_path / "data"
    jobs = [job_dict("early", write_task_data(data, "early"), 8),
            job_dict("late", write_task_data(data, "late", offset=5), 6, batch_size=3, grad_accum=2)]
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "fused", jobs, step_tokens=512)
    submissions = spec.submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model, step_tokens=512, prefetch=2),
                       "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(submissions[0], "early-1", tiny_base.tokenizer))
    events = []
    for _ in range(3):
        assert loop.run_once(idle_wait=0) is not None
    loop.assign(assignment_for(submissions[1], "late-1", tiny_base.tokenizer))  # joins while "early" runs
    events += run_until_idle(loop)
    events += loop.drain_events()
    kinds = [(e.job_id, e.kind) for e in events if e.kind in ("started", "completed")]
    assert kinds.index(("late-1", "started")) < kinds.index(("early-1", "completed"))
    steps = [json.loads(line) for line in (tmp_path / "state/trainers/trainer-t.jsonl").read_text().splitlines()]
    assert any(set(row["jobs"]) == {"early-1", "late-1"} for row in steps), "the late job never shared a step"

    for job in jobs:  # each job alone, in-process, as the reference
        solo = run_spec(str(tiny_model_dirs["llama"]), tmp_path / f"solo-{job['name']}", [job])
        train_locally(solo, base=tiny_base, progress=False)
        difference = max_relative_difference(adapter_tensors(tmp_path / "fused" / job["name"]),
                                              adapter_tensors(tmp_path / f"solo-{job['name']}" / job["name"]))
        assert difference <= 1e-4, (job["name"], difference)
        rows = [json.loads(r) for r in (tmp_path / "fused" / job["name"] / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, job["max_steps"] + 1))


def test_a_cancelled_job_leaves_a_checkpoint_and_resumes_to_the_same_adapter(tmp_path, tiny_base, tiny_model_dirs):
    data = tmp_path / "data"
    job = job_dict("resumable", write_task_data(data, "resumable"), 10, checkpoint_every=3)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job])
    (submission,) = spec.submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model), "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(submission, "resumable-1", tiny_base.tokenizer))
    for _ in range(5):
        loop.run_once(idle_wait=0)
    loop.stop_job("resumable-1", "cancelled", "test")
    events = run_until_idle(loop)
    cancelled = [e for e in events if e.kind == "cancelled"]
    assert cancelled and cancelled[0].data["checkpoint_step"] == 5
    state = json.loads((tmp_path / "out/resumable/checkpoint/state.json").read_text())
    assert state["step"] == 5
    # A new loop (a restarted trainer) resumes it from the checkpoint to the end.
    loop2 = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model), "trainer-u", tmp_path / "state")
    loop2.assign(assignment_for(submission, "resumable-1", tiny_base.tokenizer))
    events = run_until_idle(loop2)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == 5
    assert any(e.kind == "completed" for e in events)
    solo = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "solo", [job])
    train_locally(solo, base=tiny_base, progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out/resumable"),
                                         adapter_tensors(tmp_path / "solo/resumable"))
    assert difference <= 1e-5, difference
    rows = [json.loads(r) for r in (tmp_path / "out/resumable/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))


def test_a_plateau_stops_a_job_early_and_a_failing_job_fails_alone(tmp_path, tiny_base, tiny_model_dirs):
    data = tmp_path / "data"
    plateau = job_dict("flat", write_task_data(data, "flat"), 200, lr=1e-7, lr_schedule="constant",
                       eval_split=8, eval_every=2, early_stop={"min_improvement": 0.05, "patience": 3})
    bad_rows = data / "bad.jsonl"
    bad_rows.write_text('{"question": "1", "answer": "2"}\n{"question": "3"}\n')
    bad = job_dict("bad", bad_rows, 5)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [plateau, bad])
    flat_submission, bad_submission = spec.submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model), "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(flat_submission, "flat-1", tiny_base.tokenizer))
    with pytest.raises(Exception, match=r"bad.jsonl:2.*answer"):
        assignment_for(bad_submission, "bad-1", tiny_base.tokenizer)
    events = run_until_idle(loop)
    ended = [e for e in events if e.kind == "stopped_early"]
    assert ended, [e.kind for e in events][-5:]
    # lr 1e-7: its eval loss moves by far less than min_delta (0.1% of its first eval loss)
    assert "has not improved on its best" in ended[0].data["reason"] and "min_delta" in ended[0].data["reason"]
    assert ended[0].step < 40                         # far short of its 200 steps
    assert (tmp_path / "out/flat/adapter_model.safetensors").is_file()


def test_scheduler_core_keeps_jobs_through_a_restart_and_explains_waits(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("a", data, 5), job_dict("b", data, 5)])
    other = run_spec("some/other-model", tmp_path / "out2", [job_dict("c", data, 5)])
    changes, decisions = [], []
    table = JobTable(tmp_path / "state/jobs.sqlite", on_change=lambda r, prev: changes.append((r.name, prev, r.state)))
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state", on_decision=lambda *d: decisions.append(d[:2]))
    a, b = (core.submit(s) for s in spec.submissions())
    c = core.submit(other.submissions()[0])
    with pytest.raises(ValueError, match="already writes to"):
        core.submit(spec.submissions()[0])
    for _ in range(3):   # a job that keeps waiting for the same cause is reported once
        actions = core.plan([fake_status("trainer-0", "smollm2-135m")])
        if _ == 0:
            assert actions == [Start(a.id, "trainer-0"), Start(b.id, "trainer-0")]
    assert table.get(c.id).state == "queued"
    assert "no trainer holds base model 'some/other-model'" in table.get(c.id).reason
    assert changes == [("a", None, "queued"), ("b", None, "queued"), ("c", None, "queued"),
                       ("a", "queued", "running"), ("b", "queued", "running")]
    assert decisions == [("wait_no_trainer", c.id)]
    table.close()
    # restart: a new core on the same file
    table = JobTable(tmp_path / "state/jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state")
    assert sorted(core.recover()) == sorted([a.id, b.id])
    assert {r.id: r.state for r in table.all()} == {a.id: "queued", b.id: "queued", c.id: "queued"}
    assert "restarted" in table.get(a.id).reason


def test_submit_many_enters_all_jobs_or_none(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("a", data, 5), job_dict("b", data, 5)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    a, b = spec.submissions()
    clash = b.model_copy(update={"output_dir": a.output_dir})
    with pytest.raises(ValueError, match=r"nothing was submitted: submission 2 of 2 \(job 'b'\): two of the "
                                         r"submitted jobs would write to"):
        core.submit_many([a, clash])
    assert core.table.all() == []
    records = core.submit_many([a, b])
    assert [r.name for r in records] == ["a", "b"] and all(r.state == "queued" for r in records)
    # one decision round starts both
    assert core.plan([fake_status("trainer-0", "smollm2-135m")]) == [Start(r.id, "trainer-0") for r in records]
    with pytest.raises(ValueError, match="already writes to"):
        core.submit_many([spec.submissions()[1]])
    assert len(core.table.all()) == 2



def test_a_folder_an_ended_job_wrote_to_is_refused_to_a_new_job_until_that_job_is_forgotten(tmp_path):
    """The same jobs file submitted again after its jobs ended: each new job would write to the folder whose
    adapter, metrics and checkpoint the ended job left (and its record would then serve another job's adapter),
    so it is refused (409), naming the job, its state, the folder and what to do; once that job is forgotten
    (`Client.delete`) and its folder holds none of its outputs, the folder is free (one holding them:
    tests/unit/service/test_earlier_outputs.py)."""
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("a", data, 5), job_dict("b", data, 5)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    a, b = core.submit_many(spec.submissions())
    core.table.set_state(a.id, "completed", "trained 5 of 5 steps")
    core.table.set_state(b.id, "cancelled", "cancelled by the user")
    with pytest.raises(SubmissionConflict) as refused:
        core.submit_many(spec.submissions())
    message = str(refused.value)
    assert message.startswith("nothing was submitted: ")
    assert (f"job {a.id} (completed) wrote its results to {a.output_dir}, which this job would overwrite; give this "
            "job another output_dir, or forget that job (Client.delete: its files stay) and delete its files first") \
        in message
    assert f"job {b.id} (cancelled) wrote its results to {b.output_dir}" in message
    assert "resume that job (aspen resume)" in message
    assert len(core.table.all()) == 2
    core.delete(a.id)
    again = core.submit(spec.submissions()[0])
    assert again.output_dir == a.output_dir and again.state == "queued"

def test_fifo_respects_the_memory_budget():
    from policies.base import JobView, Snapshot, TrainerView

    trainer = TrainerView(id="t0", base_model="m", quantization="none", memory_budget_bytes=1000, base_bytes=500,
                          step_memory_bytes=200, jobs=(), linear_shapes=())
    jobs = tuple(JobView(id=f"j{i}", name=f"j{i}", state="queued", priority=0, submitted_at=float(i), base_model="m",
                         quantization="none", trainer=None, step=0, total_steps=10, memory_bytes=120) for i in range(4))
    decisions = FifoPolicy().decide(Snapshot(0.0, (trainer,), jobs))
    assert decisions[:2] == [Start("j0", "t0"), Start("j1", "t0")]
    assert all(isinstance(d, Wait) and "waiting for memory" in d.reason for d in decisions[2:])


def test_a_predicted_early_end_shortens_a_jobs_remaining_work(tmp_path):
    from actors.service.trainer.trainer_reports import TrainerEvent

    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("a", data, 1000)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    record = core.submit(spec.submissions()[0])
    core.apply_event("trainer-0", TrainerEvent(kind="started", job_id=record.id, step=0, data={"total_steps": 1000}))
    core.apply_event("trainer-0", TrainerEvent(kind="progress", job_id=record.id, step=100,
                                               data={"step": 100, "loss": 1.0, "tokens": 400}))
    view = core.snapshot([fake_status("trainer-0", "smollm2-135m", jobs=[record.id])]).jobs[0]
    assert view.remaining_steps == 900
    core.apply_event("trainer-0", TrainerEvent(kind="prediction", job_id=record.id, step=100,
                                               data={"predicted_stop_step": 250}))
    view = core.snapshot([fake_status("trainer-0", "smollm2-135m", jobs=[record.id])]).jobs[0]
    assert view.remaining_steps == 150 and view.remaining_tokens == 150 * 4.0


def test_a_failing_listener_does_not_stop_the_others(caplog):
    from actors.service.events.listeners import Listeners

    heard = []

    class Broken:
        def decided(self, kind, job_id, reason):
            raise RuntimeError("broker down")

    class Counting:
        def decided(self, kind, job_id, reason):
            heard.append(kind)

    listeners = Listeners([Broken(), Counting()])
    listeners.decided("preempt", "j", "why")
    assert heard == ["preempt"]
    assert "Broken failed in decided" in caplog.text


def test_a_job_stops_at_the_same_step_however_late_its_verdicts_arrive(tmp_path, tiny_base, tiny_model_dirs):
    """The stop rule fires on the losses through step k; the job ends after step k + VERDICT_LAG - 1
    whether its job actor's answers come at once or late (two random patterns), with the same adapter."""
    data = tmp_path / "data"
    plateau = job_dict("flat", write_task_data(data, "flat"), 200, lr=1e-7, lr_schedule="constant",
                       eval_split=8, eval_every=2, early_stop={"min_improvement": 0.05, "patience": 3})
    stops, adapters = [], []
    for late in (None, 1, 2):
        spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / f"out-{late}", [plateau])
        (submission,) = spec.submissions()
        job_data = JobData("flat-1", submission, tiny_base.tokenizer)
        summary = job_data.prepare()
        link = LocalJobLink(job_data) if late is None else LateVerdicts(job_data, seed=late)
        loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model), "trainer-t",
                           tmp_path / f"state-{late}")
        loop.assign(Assignment(job_id="flat-1", submission=submission, output_dir=Path(submission.output_dir),
                               data=summary, eval_examples=job_data.eval_examples(), link=link))
        events = run_until_idle(loop)
        (ended,) = [e for e in events if e.kind == "stopped_early"]
        assert job_data.decision is not None
        assert ended.step == job_data.decision.step + VERDICT_LAG - 1
        assert [e.step for e in events if e.kind == "progress"][-1] == ended.step
        stops.append(ended.step)
        adapters.append(adapter_tensors(tmp_path / f"out-{late}" / "flat"))
    assert len(set(stops)) == 1, stops
    assert all(max_relative_difference(a, adapters[0]) == 0.0 for a in adapters[1:])


class SentLink:
    """A job's link that notes, for each update it is sent, its optimizer steps, whether a fused step was
    running (its kernels queued, not yet read back: `FusedTrainer._run_step` on the stack) and the trainer's
    step count then, and whether the job was still on the loop; `fail_first`: the first update raises."""

    def __init__(self, data: JobData, loop: TrainerLoop, job_id: str, fail_first: bool = False):
        self.inner, self.loop, self.job_id, self.fail_first = LocalJobLink(data), loop, job_id, fail_first
        self.sent: list[tuple[list[int], bool, int, bool]] = []

    def fetch(self, position, count):
        return self.inner.fetch(position, count)

    def update(self, update):
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("the job actor's queue refused the call")
        during = any(frame.function == "_run_step" for frame in inspect.stack())
        self.sent.append(([row["step"] for row in update.steps], during, self.loop.trainer.step_count,
                          self.job_id in self.loop.active))
        return self.inner.update(update)


def test_each_update_is_sent_while_the_next_step_runs_and_reaches_its_job_before_its_end(
        tmp_path, tiny_base, tiny_model_dirs, caplog):
    """The job actors hear of step k while step k + 1 runs (on a GPU: no idle time between steps for their
    calls): each update once, in step order; the last one before the job's end; one whose sending raised
    during a step is sent after it, the step and the other job untouched. A due full garbage collection is
    looked for then too."""
    data = tmp_path / "data"
    jobs = [job_dict("calm", write_task_data(data, "calm"), 5),
            job_dict("flaky", write_task_data(data, "flaky", offset=5), 3)]
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", jobs, step_tokens=1024)
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model, step_tokens=1024), "trainer-t",
                       tmp_path / "state")
    links = {}
    for submission, job_id in zip(spec.submissions(), ("calm-1", "flaky-1"), strict=True):
        job_data = JobData(job_id, submission, tiny_base.tokenizer)
        summary = job_data.prepare()
        links[job_id] = SentLink(job_data, loop, job_id, fail_first=job_id == "flaky-1")
        loop.assign(Assignment(job_id=job_id, submission=submission, output_dir=Path(submission.output_dir),
                               data=summary, eval_examples=job_data.eval_examples(), link=links[job_id]))
    collections = []   # the loop's due full garbage collections: looked for while each step runs as well
    loop.collection.collect_if_due = lambda: collections.append(
        any(frame.function == "_run_step" for frame in inspect.stack())) or False
    events = run_until_idle(loop)
    assert {e.job_id: e.kind for e in events if e.kind in ("completed", "failed")} == {
        "calm-1": "completed", "flaky-1": "completed"}
    assert collections.count(True) == loop.trainer.step_count == 5
    calm, flaky = links["calm-1"].sent, links["flaky-1"].sent
    # every step's update once, in order, each while the job was on the loop (its last before its end)
    assert [steps for steps, *_ in calm] == [[1], [2], [3], [4], [5]]
    assert [steps for steps, *_ in flaky] == [[1], [2], [3]]
    assert all(on_the_loop for *_, on_the_loop in calm + flaky)
    # steps 1-4 of "calm" (trainer steps 1-4): each sent during the next step, before it was counted
    assert [(during, count) for _, during, count, _ in calm[:4]] == [(True, 1), (True, 2), (True, 3), (True, 4)]
    assert calm[4][1] is False   # the last: no step came after it; sent with its end
    # "flaky": its first update raised during step 2 and was sent after that step, before step 3's own
    assert "could not be sent during the step" in caplog.text and "queue refused" in caplog.text
    assert flaky[0][1:3] == (False, 2) and flaky[1][1:3] == (True, 2)
    rows = [json.loads(r) for r in (tmp_path / "out" / "flaky" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
