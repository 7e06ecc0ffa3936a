"""No single job, and no policy, stops the scheduler: extreme priorities order exactly as exact arithmetic
says (no overflow), a policy that raises on one job parks that job and schedules the rest, a policy that
raises on everything (or answers garbage) is replaced by FIFO, and a failing step composer leaves its
trainer training round-robin with the same results."""

from __future__ import annotations

import functools
import logging
import math
from fractions import Fraction

import pytest
import torch

from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.service.scheduler.scheduler_core import SchedulerCore, SubmissionError
from actors.service.table.job_table import JobTable
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from policies.base import JobView, Snapshot, Start, TrainerView
from policies.ordering import AdaptivePolicy
from policies.registry import load_policy
from tests.helpers.fault_policies import AlwaysFails, AnswersGarbage, FailsOnPoison
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status


def roomy_trainer() -> TrainerView:
    return TrainerView(id="t0", base_model="m", quantization="none", memory_budget_bytes=2**62, base_bytes=1,
                       step_memory_bytes=1, jobs=(), linear_shapes=())


def exact_less(a: JobView, b: JobView) -> bool:
    """Smith's rule in exact arithmetic: a.remaining / 4 ** a.priority < b.remaining / 4 ** b.priority,
    i.e. a.remaining * 4 ** (b.priority - a.priority) < b.remaining. Where the priorities differ by more
    than the work's bits can make up (|d| > 128 with remaining tokens below 2**128) the sign of d decides,
    so no power as big as 4 ** (2**70) is ever built."""
    d = b.priority - a.priority
    assert a.remaining_tokens < 2**128 and b.remaining_tokens < 2**128
    if d > 128:
        return False
    if d < -128:
        return True
    return Fraction(a.remaining_tokens) * Fraction(4) ** d < b.remaining_tokens


def exact_score(job: JobView) -> Fraction:
    """Smith's rule score in exact rational arithmetic (for priorities of moderate size)."""
    return Fraction(job.remaining_tokens) / Fraction(4) ** job.priority


@pytest.mark.parametrize("priorities", [[600, -600, 0, 3, -3], [2**70, -(2**70), 1, 100, -100]])
def test_extreme_priorities_neither_overflow_nor_misorder(priorities):
    """What older tables or other clients may still hold (priority 600, 2**70): the adaptive policy orders
    such jobs exactly as exact arithmetic does, where floats would overflow (4.0 ** 600)."""
    with pytest.raises(OverflowError):
        _ = 4.0 ** 600    # what the policy used to compute
    jobs = tuple(JobView(id=f"j{i}", name=f"j{i}", state="queued", priority=p, submitted_at=0.0, base_model="m",
                         quantization="none", trainer=None, step=0, total_steps=10 + 7 * i, memory_bytes=1,
                         tokens_per_step=100.0 + i)
                 for i, p in enumerate(priorities))
    policy = AdaptivePolicy()
    decisions = policy.decide(Snapshot(0.0, (roomy_trainer(),), jobs))
    started = [d.job for d in decisions if isinstance(d, Start)]
    assert started == [j.id for j in sorted(jobs, key=functools.cmp_to_key(
        lambda a, b: -1 if exact_less(a, b) else 1 if exact_less(b, a) else 0))]
    assert all(math.isfinite(policy.log_score(j, 0.0)) for j in jobs)


def test_preemption_decisions_match_exact_arithmetic_at_extreme_priorities():
    policy = AdaptivePolicy()
    running = JobView(id="victim", name="victim", state="running", priority=-600, submitted_at=0.0, base_model="m",
                      quantization="none", trainer="t0", step=0, total_steps=1000, memory_bytes=1,
                      tokens_per_step=100.0)
    for priority, work in ((-600, 1000), (-599, 1000), (-600, 100), (600, 10**6)):
        job = JobView(id="new", name="new", state="queued", priority=priority, submitted_at=0.0, base_model="m",
                      quantization="none", trainer=None, step=0, total_steps=work, memory_bytes=1,
                      tokens_per_step=100.0)
        queued_victim = JobView(id="victim", name="victim", state="queued", priority=-600, submitted_at=0.0,
                                base_model="m", quantization="none", trainer=None, step=0, total_steps=1000,
                                memory_bytes=1, tokens_per_step=100.0)
        exact = (exact_score(job) < exact_score(queued_victim)
                 and exact_score(queued_victim) >= 4 * exact_score(job))
        assert policy.may_preempt(job, running, 0.0) == exact, (priority, work)


def core_with(policy, tmp_path, names=("alpha", "poison", "gamma")) -> tuple[SchedulerCore, list]:
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(name, data, 5) for name in names])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), policy, tmp_path / "state")
    return core, core.submit_many(spec.submissions())


def test_a_policy_that_fails_on_one_job_parks_it_and_schedules_the_others(tmp_path, caplog):
    core, (alpha, poison, gamma) = core_with(FailsOnPoison(), tmp_path)
    actions = core.plan([fake_status("trainer-0", "smollm2-135m")])
    assert actions == [Start(alpha.id, "trainer-0"), Start(gamma.id, "trainer-0")]
    parked = core.table.get(poison.id)
    assert parked.state == "paused"
    assert "policy 'fails-on-poison' fails on this job" in parked.reason and "poison pill" in parked.reason
    assert core.policy.name == "fails-on-poison" and core.policy_error is None   # the policy stays
    assert "parked" in caplog.text
    # the service goes on: a job submitted later is started by the same policy
    later = core.submit_many(run_spec("smollm2-135m", tmp_path / "later", [
        job_dict("delta", write_task_data(tmp_path / "data", "d"), 5)]).submissions())[0]
    assert core.plan([fake_status("trainer-0", "smollm2-135m")]) == [Start(later.id, "trainer-0")]


@pytest.mark.parametrize("policy", [AlwaysFails(), AnswersGarbage()], ids=["raises", "garbage"])
def test_a_policy_that_fails_on_everything_is_replaced_by_fifo(policy, tmp_path, caplog):
    core, records = core_with(policy, tmp_path)
    with caplog.at_level(logging.ERROR):
        actions = core.plan([fake_status("trainer-0", "smollm2-135m")])
    assert actions == [Start(r.id, "trainer-0") for r in records]     # FIFO: submission order
    assert core.policy.name == "fifo"
    assert core.policy_error and policy.name in core.policy_error and "FIFO" in core.policy_error
    assert "schedules FIFO" in caplog.text
    assert all(core.table.get(r.id).state == "running" for r in records)   # nobody was parked for it


def test_a_policy_failing_on_several_single_jobs_is_replaced_and_they_are_given_back(tmp_path):
    """Parking job after job would be the policy's fault, not theirs: after a few it is replaced, and the
    parked jobs are queued again."""
    core, records = core_with(FailsOnPoison(), tmp_path, names=("poison",))
    status = fake_status("trainer-0", "smollm2-135m")
    assert core.plan([status]) == []
    for index in range(2):
        data = write_task_data(tmp_path / "data", f"p{index}")
        spec = run_spec("smollm2-135m", tmp_path / f"more{index}", [job_dict("poison", data, 5)])
        records += core.submit_many(spec.submissions())
        core.plan([status])
    assert core.policy.name == "fifo"
    assert {core.table.get(r.id).state for r in records} <= {"queued", "running"}
    core.plan([status])
    assert all(core.table.get(r.id).state == "running" for r in records)


def test_an_estimator_failing_on_one_job_parks_only_that_job(tmp_path, monkeypatch):
    core, (alpha, poison, gamma) = core_with(load_policy("adaptive"), tmp_path)
    original = core._job_view

    def failing(record, trainers):
        if record.name == "poison":
            raise ArithmeticError("estimate blew up")
        return original(record, trainers)

    monkeypatch.setattr(core, "_job_view", failing)
    actions = core.plan([fake_status("trainer-0", "smollm2-135m")])
    assert sorted(a.job for a in actions) == sorted([alpha.id, gamma.id])
    assert core.table.get(poison.id).state == "paused"
    assert "could not estimate" in core.table.get(poison.id).reason


def test_a_batch_with_one_unusable_job_enters_nothing(tmp_path):
    """A batch is all or none, checked by the service too (not only by the client): ten submissions whose
    seventh asks for a micro-batch no trainer can step."""
    from actors.service.scheduler.config import TrainerConfig

    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(f"j{i}", data, 5) for i in range(10)])
    submissions = spec.submissions()
    too_big = submissions[6].job.model_copy(update={"batch_size": 64, "max_seq_len": 4096})
    submissions[6] = JobSubmission(job=too_big, output_dir=submissions[6].output_dir)
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), load_policy("fifo"), tmp_path / "state",
                         trainers=[TrainerConfig(step_tokens=4096)])
    with pytest.raises(SubmissionError, match=r"nothing was submitted: submission 7 of 10 \(job 'j6'\): .*"
                                              r"batch_size 64 \* max_seq_len 4096 .* exceeds step_tokens 4096"):
        core.submit_many(submissions)
    assert core.table.all() == []
    records = core.submit_many(spec.submissions())
    assert len(records) == 10


def test_output_dirs_stay_under_a_shared_services_root(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    root = tmp_path / "root"
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), load_policy("fifo"), tmp_path / "state",
                         output_root=root)
    job = JobSpec.model_validate(job_dict("a", data, 5))
    for outside in ("/etc/aspen-owned", str(root / ".." / "escape")):
        with pytest.raises(SubmissionError, match=r"outside this service's output root .*root"):
            core.submit(JobSubmission(job=job, output_dir=outside))
    assert core.table.all() == []
    placed = core.submit(JobSubmission(job=job))
    assert placed.output_dir == str((root / placed.id).resolve())
    relative = core.submit(JobSubmission(job=job, output_dir="team/a"))
    assert relative.output_dir == str((root / "team/a").resolve())


def test_a_jobs_file_whose_output_dir_is_outside_the_root_is_told_once(tmp_path):
    """Four jobs of a file whose output_dir the shared service refuses: one reason, naming the four jobs and the
    file's folder, not four copies of it; a job that fails for a reason of its own is still told apart."""
    from actors.service.scheduler.config import TrainerConfig

    data = write_task_data(tmp_path / "data", "t")
    root = tmp_path / "root"
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), load_policy("fifo"), tmp_path / "state",
                         output_root=root, trainers=[TrainerConfig(step_tokens=4096)])
    outside = tmp_path / "elsewhere"
    spec = run_spec("smollm2-135m", outside, [job_dict(f"j{i}", data, 5) for i in range(4)])
    with pytest.raises(SubmissionError) as refused:
        core.submit_many(spec.submissions())
    message = str(refused.value)
    assert message.count("outside this service's output root") == 1, message
    assert message.startswith("nothing was submitted: submissions 1-4 of 4 (jobs 'j0', 'j1', 'j2', 'j3'): "
                              f"output_dir {outside.resolve()}/<job name> is outside"), message
    submissions = spec.submissions()
    submissions[2] = JobSubmission(job=submissions[2].job, output_dir="team/j2")   # under the root: fine
    too_big = submissions[3].job.model_copy(update={"batch_size": 64, "max_seq_len": 4096})
    submissions[3] = JobSubmission(job=too_big, output_dir="team/j3")
    with pytest.raises(SubmissionError) as refused:
        core.submit_many(submissions)
    message = str(refused.value)
    assert "submissions 1-2 of 4 (jobs 'j0', 'j1'): output_dir" in message, message
    assert "submission 4 of 4 (job 'j3'): batch_size 64 * max_seq_len 4096" in message, message
    assert "j2" not in message
    assert core.table.all() == []


def test_a_failing_step_composer_leaves_the_trainer_training_with_the_same_results(caplog):
    class Broken:
        def compose_step(self, batches, cost, step_tokens, fits):
            raise RuntimeError("composer bug")

    results = []
    for composer in (None, Broken()):
        base = from_module(tiny_model("llama", 300), None)
        trainer = FusedTrainer(base, composer=composer)
        jobs = [TrainingJob.create(JobSpec(name=f"j{i}", data="x", format={"type": "text"}, batch_size=2,
                                           max_steps=4, lora={"r": 4, "alpha": 8}),
                                   base, random_examples(i, count=8, vocab=300), [], seed=i) for i in range(2)]
        for job in jobs:
            trainer.add_job(job)
        while trainer.train_step() is not None:
            pass
        results.append({k: v.detach().clone() for job in jobs for k, v in job.adapter.named_parameters()})
        assert all(job.step == 4 for job in jobs)
    assert "composer bug" in caplog.text and caplog.text.count("step composer Broken failed") == 1
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=0, atol=0)


def test_a_parked_job_deleted_before_the_policy_is_replaced_is_not_given_back(tmp_path):
    """A job parked for the policy and then deleted by its user is gone: when the policy is replaced by FIFO
    later, only the parked jobs that still exist are queued again, and the round goes on."""
    core, [poison] = core_with(FailsOnPoison(), tmp_path, names=("poison",))
    status = fake_status("trainer-0", "smollm2-135m")
    assert core.plan([status]) == []
    assert core.table.get(poison.id).state == "paused"
    core.delete(poison.id)
    more = []
    for index in range(2):   # two more jobs it fails on, alone each: the policy is replaced
        spec = run_spec("smollm2-135m", tmp_path / f"more{index}",
                        [job_dict("poison", write_task_data(tmp_path / "data", f"p{index}"), 5)])
        more += core.submit_many(spec.submissions())
    assert core.plan([status]) == [Start(r.id, "trainer-0") for r in more]
    assert core.policy.name == "fifo" and "fails-on-poison" in core.policy_error
