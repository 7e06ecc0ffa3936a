"""Interactive models as jobs (actors/service/scheduler/interactive_jobs.py) in a real job table with a real
scheduler core: a model is entered running on the trainer holding its base with the most room, its memory
(the same estimate as a job's adapter) held there, so that a model that no longer fits is refused for now and
the policy's plan leaves it where it is (a job a round started there counts before its trainer reports it); a
user's quotas hold; a lost trainer queues it for its front to place again (never for the policy to start), and a
restart of the service fails it; a jobs file of method interactive is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.service.scheduler.interactive_jobs import NoRoom
from actors.service.scheduler.job_fit import job_adapter_bytes, trainer_view
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from actors.spec.job_spec import JobSpec
from actors.spec.model_parts import part_targets
from policies.base import UserShare
from policies.fifo import FifoPolicy
from tests.helpers.policy_service import core_with
from tests.helpers.scheduler_fakes import status
from tests.helpers.trainer import fake_status

pytestmark = pytest.mark.unit


def core_of(tmp_path) -> SchedulerCore:
    return SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")


def test_a_model_runs_on_the_trainer_with_the_most_room_and_its_memory_is_held_there(tmp_path):
    core = core_of(tmp_path)
    small, large = status("trainer-0"), replace(status("trainer-1"), memory_budget_bytes=20 * 2**30)
    with core.table.transaction():
        opened = core.interactive.open("s1:train:0", "smollm2-135m", 8, "alice", [small, large])
    record = core.table.get(opened.record.id)
    assert (opened.trainer, record.state, record.trainer, record.user) == ("trainer-1", "running", "trainer-1",
                                                                            "alice")
    submission = core.table.submission(record.id)
    assert submission.job.method == "interactive" and submission.job.lora.r == 8
    assert submission.job.lora.target_modules == ["q_proj", "v_proj"]   # the tiny status's linear layers
    need = job_adapter_bytes(submission.job.lora, trainer_view(large))
    assert core.scheduling.get(record.id).memory == need > 0
    # the trainer now reports the model among its jobs: a model that would not fit beside it is refused for now
    held = replace(large, jobs=[record.id])
    view = trainer_view(held)
    tight = replace(held, memory_budget_bytes=view.base_bytes + view.step_memory_bytes + need + need // 2)
    with pytest.raises(NoRoom, match="no ready trainer holding smollm2-135m has room"):
        with core.table.transaction():
            core.interactive.open("s1:train:1", "smollm2-135m", 8, "alice", [tight])
    # the policy's round sees it running there and starts nothing for it
    with core.table.transaction():
        assert core.plan([held]) == []
    assert core.table.get(record.id).state == "running"


def test_a_base_no_trainer_holds_and_the_users_quotas_are_refused_saying_so(tmp_path):
    core = core_of(tmp_path)
    with pytest.raises(ValueError, match="'other-base' is not held"):
        core.interactive.open("s1:train:0", "other-base", 8, "alice", [status("trainer-0")])
    with pytest.raises(ValueError, match="tokens_per_day"):
        core.interactive.open("s1:train:0", "smollm2-135m", 8, "alice", [status("trainer-0")],
                              standing=UserShare(tokens_per_day=100, tokens_today=100))
    with core.table.transaction():
        core.interactive.open("s1:train:0", "smollm2-135m", 8, "alice", [status("trainer-0")],
                              standing=UserShare(max_running=1))
    with pytest.raises(NoRoom, match="max_running"):
        core.interactive.open("s1:train:1", "smollm2-135m", 8, "alice", [status("trainer-0")],
                              standing=UserShare(max_running=1))


def test_a_lost_trainer_queues_the_model_for_its_front_which_places_it_again(tmp_path):
    core = core_of(tmp_path)
    with core.table.transaction():
        job = core.interactive.open("s1:train:0", "smollm2-135m", 4, "bob", [status("trainer-0")]).record.id
        core.apply_event("trainer-0", TrainerEvent(kind="checkpoint", job_id=job, step=6))
    with pytest.raises(NoRoom, match="not booked yet"):   # the front found the trainer dead before the scheduler
        core.interactive.reopen(job, "trainer-0", [status("trainer-1")])
    with core.table.transaction():
        assert core.trainer_lost("trainer-0", "killed") == []   # not queued for the policy to start
    record = core.table.get(job)
    assert record.state == "queued" and "resumes from its checkpoint at step 6" in record.reason
    with core.table.transaction():
        assert core.plan([status("trainer-1")]) == []            # the policy leaves it to its front
    with core.table.transaction():
        placed = core.interactive.reopen(job, "trainer-0", [status("trainer-1")])
    assert placed.trainer == "trainer-1" and core.table.get(job).state == "running"
    assert core.interactive.reopen(job, "trainer-0", [status("trainer-1")]).trainer == "trainer-1"   # a retry
    with core.table.transaction():
        core.interactive.close(job, "completed", "its session ended", "/models/s1-train-0")
    with pytest.raises(KeyError, match="has ended"):
        core.interactive.reopen(job, "trainer-1", [status("trainer-1")])


def test_a_restarted_service_fails_its_interactive_models_and_they_cannot_be_paused_or_resumed(tmp_path):
    core = core_of(tmp_path)
    with core.table.transaction():
        job = core.interactive.open("s1:train:0", "smollm2-135m", 4, "bob", [status("trainer-0")]).record.id
    with pytest.raises(ValueError, match="cannot be paused"):
        core.pause(job)
    restarted = core_of(tmp_path)
    with restarted.table.transaction():
        restarted.recover()
    record = restarted.table.get(job)
    assert record.state == "failed" and "restarted" in record.reason
    with pytest.raises(ValueError, match="ends with its session"):
        restarted.resume(job)


def test_a_jobs_file_or_submission_of_method_interactive_is_refused():
    from actors.spec.run_spec import RunSpec

    with pytest.raises(ValueError, match="never submitted"):
        RunSpec(jobs=[JobSpec(name="x", method="interactive")])
    with pytest.raises(ValueError, match="remove data and format"):
        JobSpec(name="x", method="interactive", data="rows.jsonl", format={"type": "text"})
    with pytest.raises(ValueError, match="needs data and format"):
        JobSpec(name="x")
    assert part_targets(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"],
                        train_attn=False, train_mlp=True) == ["up_proj"]


def test_a_model_that_trains_the_lm_head_holds_its_head_adapter_too(tmp_path):
    """`train_unembed`: the head's adapter counted beside the layers' (r x (hidden + vocabulary) parameters a rank,
    as tinker-cookbook's per-rank counts have it: Qwen3-8B's "unembed" 156,032 = 4,096 + 151,936), each with its
    gradient and AdamW's two moments in float32; the head alone is a model too."""
    from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER

    core = core_of(tmp_path)
    trainer = replace(status("trainer-0"), head_shape=(576, 49152), memory_budget_bytes=20 * 2**30)
    with core.table.transaction():
        plain = core.interactive.open("s1:train:0", "smollm2-135m", 8, "alice", [trainer])
        with_head = core.interactive.open("s1:train:1", "smollm2-135m", 8, "alice", [trainer], train_unembed=True)
        head_only = core.interactive.open("s1:train:2", "smollm2-135m", 8, "alice", [trainer], train_attn=False,
                                          train_mlp=False, train_unembed=True)
    head_bytes = BYTES_PER_ADAPTER_PARAMETER * 8 * (576 + 49152)
    memory = {opened.record.id: core.scheduling.get(opened.record.id).memory
              for opened in (plain, with_head, head_only)}
    assert memory[with_head.record.id] == memory[plain.record.id] + head_bytes
    assert memory[head_only.record.id] == head_bytes
    assert core.table.submission(with_head.record.id).job.lora.target_modules == ["q_proj", "v_proj", "lm_head"]
    with pytest.raises(ValueError, match="all false: nothing to train"):
        core.interactive.open("s1:train:3", "smollm2-135m", 8, "alice", [trainer], train_attn=False,
                              train_mlp=False)


def test_a_model_is_refused_beside_a_job_started_on_the_trainer_that_the_trainer_does_not_report_yet(tmp_path):
    """A round's Start puts a job running on its trainer in the table at once; the trainer reports it among its jobs
    only once its job actor has started (seconds later). A model opened meanwhile was placed by the trainer's report
    alone, past its budget. The reference: the trainer's budget against its base, a full step, the job's and the
    model's memory, summed here."""
    core, (job,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))
    probe = fake_status("trainer-0", "smollm2-135m")
    view = trainer_view(probe)
    lora = JobSpec(name="m", method="interactive", lora={"r": 64, "target_modules": ["q_proj", "v_proj"]},
                   max_steps=None, epochs=None).lora
    model_bytes = job_adapter_bytes(lora, view)
    job_bytes = job_adapter_bytes(core.table.submission(job.id).job.lora, view)
    budget = view.base_bytes + view.step_memory_bytes + max(model_bytes, job_bytes)   # either alone fits, not both
    assert model_bytes > 0 and job_bytes > 0
    trainer = fake_status("trainer-0", "smollm2-135m", budget=budget)   # it reports no job yet
    with core.table.transaction():
        assert [a.job for a in core.plan([trainer])] == [job.id]
    assert core.table.get(job.id).trainer == "trainer-0" and trainer.jobs == []
    with pytest.raises(NoRoom, match="no ready trainer holding smollm2-135m has room"):
        with core.table.transaction():
            core.interactive.open("s1:train:0", "smollm2-135m", 64, "bob", [trainer])
    alone = fake_status("trainer-0", "smollm2-135m", budget=budget)
    with core.table.transaction():   # once the job has ended, the model fits
        core.table.set_state(job.id, "completed", "done", trainer=None)
        assert core.interactive.open("s1:train:0", "smollm2-135m", 64, "bob", [alone]).trainer == "trainer-0"
