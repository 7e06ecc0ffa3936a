"""A plug-in policy's `Start`s that the scheduler cannot carry out are refused, the job left queued with the reason:
a job started on two trainers in one round (both were started: one job trained twice into one folder), on a trainer
of another base model (started there, its adapter trained on the wrong model), on a trainer that does not exist, or
past a trainer's memory budget or max_jobs (started there). The reference is the FIFO policy's placement on the same
trainers (Admission, policies/base.py): what the scheduler now carries out of a greedy policy's decisions."""

from __future__ import annotations

import dataclasses

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from policies.base import Decision, Snapshot, Start
from policies.fifo import FifoPolicy
from tests.helpers.scheduler_fakes import BUSY_S, status
from tests.helpers.service import job_dict, run_spec, write_task_data


class Greedy:
    """Every queued job on `trainer`, and (`twice`) again on `again`: what a careless plug-in may answer."""

    name = "greedy"

    def __init__(self, trainer: str = "trainer-0", again: str | None = None):
        self.trainer, self.again = trainer, again

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        decisions: list[Decision] = [Start(j.id, self.trainer) for j in snapshot.queued()]
        if self.again is not None:
            decisions += [Start(j.id, self.again) for j in snapshot.queued()]
        return decisions


def _plan(tmp_path, policy, trainers, names=("a", "b")) -> tuple[list, dict]:
    """The scheduler's actions for `policy` over new jobs `names` and the jobs' (state, trainer, reason) after."""
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(name, data, 10) for name in names])
    table = JobTable(tmp_path / "state/jobs.sqlite", busy_timeout=BUSY_S)
    core = SchedulerCore(table, policy, tmp_path / "state")
    core.submit_many(spec.submissions())
    with table.transaction():
        actions = core.plan(trainers)
    return actions, {r.name: (r.state, r.trainer, r.reason) for r in table.all()}


def test_a_job_started_on_two_trainers_in_one_round_starts_once(tmp_path):
    trainers = [status("trainer-0"), status("trainer-1")]
    actions, jobs = _plan(tmp_path / "greedy", Greedy(again="trainer-1"), trainers)
    assert [(a.trainer) for a in actions] == ["trainer-0", "trainer-0"], actions   # each job once, where first put
    assert len({a.job for a in actions}) == 2
    assert {name: job[:2] for name, job in jobs.items()} == {"a": ("running", "trainer-0"),
                                                            "b": ("running", "trainer-0")}


def test_a_start_on_a_trainer_of_another_base_model_or_none_leaves_the_job_queued_saying_why(tmp_path):
    other = dataclasses.replace(status("trainer-0"), base_model="other-model")
    actions, jobs = _plan(tmp_path / "base", Greedy(), [other])
    assert actions == _plan(tmp_path / "fifo", FifoPolicy(), [other])[0] == []
    state, trainer, reason = jobs["a"]
    assert (state, trainer) == ("queued", None)
    assert ("the scheduling policy 'greedy' started it on trainer-0, but trainer-0 holds base model 'other-model' "
            "(none), not the job's 'smollm2-135m' (none)") in reason, reason

    actions, jobs = _plan(tmp_path / "gone", Greedy("trainer-9"), [status("trainer-0")])
    assert actions == []
    assert "started it on trainer-9, but there is no trainer 'trainer-9' (trainers now: trainer-0)" in jobs["a"][2]


def test_starts_past_a_memory_budget_or_max_jobs_are_refused_as_fifo_would_not_make_them(tmp_path):
    """A budget that holds the base, a step and one job's memory (not two); and a trainer of max_jobs 1."""
    trainer = status("trainer-0")
    probe = JobTable(tmp_path / "probe/jobs.sqlite", busy_timeout=BUSY_S)
    core = SchedulerCore(probe, FifoPolicy(), tmp_path / "probe")
    data = write_task_data(tmp_path / "data", "t")
    core.submit_many(run_spec("smollm2-135m", tmp_path / "probe-out", [job_dict("a", data, 10)]).submissions())
    need = core.snapshot([trainer]).jobs[0].memory_bytes
    assert need and need > 0
    tight = dataclasses.replace(trainer, memory_budget_bytes=trainer.base_bytes + trainer.activation_bytes_estimate
                                + need + need // 2)
    for case, limited in (("memory", tight), ("slots", dataclasses.replace(trainer, max_jobs=1))):
        fifo, _ = _plan(tmp_path / f"fifo-{case}", FifoPolicy(), [limited])
        actions, jobs = _plan(tmp_path / case, Greedy(), [limited])
        assert len(fifo) == 1 and [a.trainer for a in actions] == [a.trainer for a in fifo], (case, actions, fifo)
        assert jobs["a"][:2] == ("running", "trainer-0") and jobs["b"][:2] == ("queued", None), (case, jobs)
        expected = "MiB free" if case == "memory" else "has no free job slot (its max_jobs 1"
        assert expected in jobs["b"][2], (case, jobs["b"])


class Silent:
    """Answers nothing: no Start, no Wait."""

    name = "silent"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return []


def test_a_queued_job_the_policy_neither_starts_nor_waits_says_the_policy_left_it_undecided(tmp_path):
    """Its reason was "submitted" for ever (`aspen run` ended "job a queued: submitted"), naming no policy; FIFO (the
    reference) gives each job it does not start a Wait with the reason, which stands."""
    actions, jobs = _plan(tmp_path / "silent", Silent(), [status("trainer-0")])
    assert actions == []
    for state, _, reason in jobs.values():
        assert state == "queued"
        assert reason.startswith("waiting: the scheduling policy 'silent' neither started it nor said why it waits"), \
            reason
    full = dataclasses.replace(status("trainer-0"), max_jobs=1)
    _, fifo = _plan(tmp_path / "fifo", FifoPolicy(), [full])
    assert fifo["b"][0] == "queued" and fifo["b"][2].startswith("waiting for a free slot"), fifo


class ListJobId:
    """Starts a job whose id is a list (a policy author's slip: `Start([job.id], trainer)`)."""

    name = "list-job-id"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return [Start([j.id], "trainer-0") for j in snapshot.queued()]   # type: ignore[arg-type]


def test_a_decision_whose_job_id_is_not_a_str_replaces_the_policy_by_fifo_not_stopping_the_scheduler(tmp_path):
    """Its round raised TypeError (unhashable type: 'list') in the scheduler, every round after it alike: no job of
    anyone's started again. Now it is a policy answering garbage, replaced by FIFO (the reference: FIFO's placement)."""
    trainers = [status("trainer-0"), status("trainer-1")]
    actions, jobs = _plan(tmp_path / "list", ListJobId(), trainers)
    fifo, _ = _plan(tmp_path / "fifo", FifoPolicy(), trainers)
    assert [a.trainer for a in actions] == [a.trainer for a in fifo] and len(actions) == 2, (actions, fifo)
    assert all(state == "running" for state, _, _ in jobs.values()), jobs


def test_a_start_past_its_users_running_quota_is_refused_as_fifo_holds_it_back(tmp_path):
    """alice may run 1 job at once (users.json, `aspen user add --quota running=1`); a policy that does not ask
    `Admission` started both of her jobs, her quota kept by the built-in policies only."""
    from actors.service.accounts.users import UserBook

    runs = {}
    for policy in (Greedy(), FifoPolicy()):
        folder = tmp_path / policy.name
        (folder / "state").mkdir(parents=True)
        UserBook.in_state_dir(folder / "state").add("alice", quotas={"running": 1}, data_roots=[str(folder)])
        data = write_task_data(folder / "data", "t")
        spec = run_spec("smollm2-135m", folder / "out", [job_dict(name, data, 10) for name in ("a", "b")])
        table = JobTable(folder / "state/jobs.sqlite", busy_timeout=BUSY_S)
        core = SchedulerCore(table, policy, folder / "state")
        core.submit_many([s.model_copy(update={"user": "alice", "output_dir": None}) for s in spec.submissions()])
        with table.transaction():
            actions = core.plan([status("trainer-0")])
        runs[policy.name] = (len(actions), {r.name: (r.state, r.reason) for r in table.all()})
    assert runs["greedy"][0] == runs["fifo"][0] == 1, runs
    state, reason = runs["greedy"][1]["b"]
    assert state == "queued" and "its user's quota holds it back (waiting for a job of alice to end: their quota is " \
                                 "1 running at once)" in reason, reason
