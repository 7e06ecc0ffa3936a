"""A plug-in policy's Start re-checked against the trainer as it is when applied (policy_answer.py) counted what
started there while the policy decided (an interactive model opened) but never gave back what left it meanwhile (a
job completed, paused or cancelled): a Start that fitted beside the new model in the room the ended job freed was
not carried out, and the job waited a round (or more, with a slow policy) for nothing. What left is now given back,
what started is still counted, and the two net out: never past the trainer's memory budget, its `max_jobs`, or its
user's `max_running`.

The reference: the same service, the same jobs, the job ended and the model opened before the round's snapshot
rather than while the policy decided (a round without the overlap): the same decisions must be carried out."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from actors.service.accounts.users import UserBook
from actors.service.scheduler.interactive_jobs import interactive_submission
from actors.service.scheduler.job_fit import job_adapter_bytes, trainer_view
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.base import Decision, Snapshot
from policies.fifo import FifoPolicy
from tests.helpers.policy_service import ServiceLoop
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status

BASE = "smollm2-135m"
TARGETS = ["q_proj", "v_proj"]   # fake_status's layers: what an interactive model with train_attn adapts there
PROBE = fake_status("trainer-0", BASE)
FIXED = PROBE.base_bytes + PROBE.activation_bytes_estimate   # the trainer's weights and a full step


def model_bytes(rank: int) -> int:
    return job_adapter_bytes(interactive_submission("m", BASE, rank, TARGETS, "bob").job.lora, trainer_view(PROBE))


class Gated(FifoPolicy):
    """FIFO, but its call on the first snapshot where the job named `name` is queued answers only once `go` is set
    (the test changes the service meanwhile, with the service's lock released as the round leaves it)."""

    name = "gated"

    def __init__(self, name: str):
        self.job_name = name
        self.entered = threading.Event()
        self.go = threading.Event()
        self.answer: list[Decision] | None = None

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        answer = super().decide(snapshot)
        if not self.entered.is_set() and any(j.name == self.job_name and j.state == "queued" for j in snapshot.jobs):
            self.entered.set()
            assert self.go.wait(30), "the test never let the policy answer"
            self.answer = answer
        return answer


def submit(core: SchedulerCore, tmp_path, name: str, user: str | None) -> str:
    out = tmp_path / "state/outputs" / user if user else tmp_path / "out"   # a shared service's jobs write there
    spec = run_spec(BASE, out / name, [job_dict(name, write_task_data(tmp_path / "data", name), 5)])
    (submission,) = spec.submissions()
    return core.submit(submission.model_copy(update={"user": user})).id


def ends(core: SchedulerCore, job_id: str, how: str) -> None:
    """`job_id` leaves its trainer as a user or its end has it: the trainer's final event, booked."""
    if how == "paused":
        _, stop = core.pause(job_id)
    elif how == "cancelled":
        _, stop = core.cancel(job_id)
    else:
        stop = None
    assert how == "completed" or stop is not None   # running on its trainer: ended by the trainer's report
    with core.table.transaction():
        core.apply_event("trainer-0", TrainerEvent(kind=how, job_id=job_id, step=2, data={"reason": how}))


# each room the ended job gives back, and how it ends: the trainer's memory (alpha and beta fit together, beta and
# the model too, not the three), its max_jobs (two), its user's max_running (two)
ROOMS = {"memory": ("completed", FIXED + 2 * model_bytes(4), None, None),
         "slots": ("paused", 10 * 2**30, 2, None),
         "quota": ("cancelled", 10 * 2**30, None, 2)}


def one_round(tmp_path, room: str, overlap: bool, rank: int = 4) -> dict:
    """alpha runs; beta is submitted, and the round that decides it sees alpha running; alpha ends and bob's
    interactive model (of `rank`) opens on the trainer, while that round's policy decides (`overlap`) or before its
    snapshot. What that round carried out, and beta then."""
    how, budget, max_jobs, max_running = ROOMS[room]
    if max_running is not None:
        UserBook.in_state_dir(tmp_path / "state").add("bob", quotas={"running": max_running},
                                                      data_roots=[str(tmp_path / "data")])
    policy = Gated("beta")
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), policy, tmp_path / "state", policy_timeout_s=60.0)
    service = ServiceLoop(core)
    service.status = dataclasses.replace(fake_status("trainer-0", BASE, budget=budget), max_jobs=max_jobs)
    user = "bob" if max_running is not None else None
    alpha = submit(core, tmp_path, "alpha", user)

    def change() -> str:
        ends(core, alpha, how)
        standing = core.standing().get(user) if user else None
        return core.interactive.open("s1:train:0", BASE, rank, "bob", [service.status], standing=standing).record.id

    with service:
        assert service.wait_until(lambda: core.table.get(alpha).state == "running"), "alpha never started"
        model = None if overlap else service.locked(change)
        beta = service.locked(lambda: submit(core, tmp_path, "beta", user))
        assert policy.entered.wait(30), "the policy was never asked about beta"
        number = service.locked(lambda: len(service.rounds))   # the round waiting for the policy, not appended yet
        if overlap:
            model = service.locked(change)
        policy.go.set()
        assert service.wait_until(lambda: len(service.rounds) > number), "the round never ended"
        carried = service.locked(lambda: [(core.table.get(a.job).name, type(a).__name__, getattr(a, "trainer", None))
                                          for a in service.rounds[number]])
        beta_now = service.locked(lambda: core.table.get(beta))
    return {"carried": carried, "beta": beta_now, "model": core.table.get(model), "answer": policy.answer,
            "alpha": core.table.get(alpha), "beta_id": beta,
            "alpha_bytes": job_adapter_bytes(core.table.submission(alpha).job.lora, trainer_view(PROBE))}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_start_that_fits_in_the_room_a_job_freed_while_the_policy_decided_is_carried_out_that_round(tmp_path,
                                                                                                   room):
    reference = one_round(tmp_path / "reference", room, overlap=False)
    overlapped = one_round(tmp_path / "overlapped", room, overlap=True)
    how = ROOMS[room][0]
    for run in (reference, overlapped):
        assert run["alpha"].state == how and run["model"].state == "running" and run["model"].trainer == "trainer-0"
    # the policy started beta on both snapshots: alpha running beside it, or the model
    assert [type(d).__name__ for d in overlapped["answer"] if d.job == overlapped["beta_id"]] == ["Start"]
    assert reference["carried"] == [("beta", "Start", "trainer-0")], reference
    assert overlapped["carried"] == reference["carried"], overlapped["beta"].reason
    assert overlapped["beta"].state == "running" and overlapped["beta"].reason == "starting on trainer-0"


def test_a_job_that_left_and_a_model_that_opened_while_the_policy_decided_net_out(tmp_path):
    """The safe side: the model (rank 8, twice alpha's memory) takes more than alpha freed; beta, which fitted
    beside alpha, fits beside neither that model nor in the two together's room, and is not started, as the round
    without the overlap does not start it either."""
    assert model_bytes(8) > model_bytes(4) and model_bytes(8) + model_bytes(4) > ROOMS["memory"][1] - FIXED
    reference = one_round(tmp_path / "reference", "memory", overlap=False, rank=8)
    overlapped = one_round(tmp_path / "overlapped", "memory", overlap=True, rank=8)
    assert reference["carried"] == overlapped["carried"] == []
    assert reference["beta"].state == overlapped["beta"].state == "queued"
    assert reference["beta"].reason.startswith("waiting for memory"), reference["beta"].reason
    model, alpha, need = overlapped["model"].id, overlapped["alpha"].id, overlapped["alpha_bytes"] / 2**20
    free = ROOMS["memory"][1] - FIXED - model_bytes(8)
    assert overlapped["beta"].reason == (
        f"waiting: the scheduling policy 'gated' started it on trainer-0, but while the policy decided, {model} "
        f"({model_bytes(8) / 2**20:.1f} MiB) started on trainer-0 and {alpha} ({need:.1f} MiB) left it: it "
        f"needs {need:.1f} MiB and trainer-0's memory budget has {free / 2**20:.1f} MiB free "
        "now; it stays queued and the next round decides again"), overlapped["beta"].reason


def test_a_model_its_user_opened_on_another_trainer_while_the_policy_decided_counts_in_their_quota(tmp_path):
    """The re-check looked only at the Start's own trainer: bob's model opened on trainer-1 while the policy
    decided left trainer-0 as the snapshot showed it, and bob's job was started there past his max_running (two):
    three running at once. The reference: his quota, and the round without the overlap, which starts nothing
    (trainer-1 has room for a rank-2 model, not for beta: the policy starts beta on trainer-0)."""
    runs = {}
    for overlap in (False, True):
        folder = tmp_path / ("overlapped" if overlap else "reference")
        UserBook.in_state_dir(folder / "state").add("bob", quotas={"running": 2}, data_roots=[str(folder / "data")])
        policy = Gated("beta")
        core = SchedulerCore(JobTable(folder / "state/jobs.sqlite"), policy, folder / "state", policy_timeout_s=60.0)
        service = ServiceLoop(core)
        other = fake_status("trainer-1", BASE, budget=FIXED + model_bytes(2))   # a small model's room, not beta's
        service._round = lambda number, core=core, service=service, other=other: service.rounds.append(
            core.plan([service.status, other], service.loop.unlocked))
        alpha = submit(core, folder, "alpha", "bob")

        def opens(core=core, other=other) -> str:
            return core.interactive.open("s1:train:0", BASE, 2, "bob", [other],
                                         standing=core.standing()["bob"]).record.id

        with service:
            assert service.wait_until(lambda core=core, alpha=alpha: core.table.get(alpha).state == "running")
            model = None if overlap else service.locked(opens)
            beta = service.locked(lambda core=core, folder=folder: submit(core, folder, "beta", "bob"))
            assert policy.entered.wait(30), "the policy was never asked about beta"
            number = service.locked(lambda service=service: len(service.rounds))
            if overlap:
                model = service.locked(opens)
            policy.go.set()
            assert service.wait_until(lambda service=service, number=number: len(service.rounds) > number)
            carried = service.locked(lambda service=service, number=number: service.rounds[number])
            running = service.locked(lambda core=core: [r.id for r in core.table.all(("running",)) if r.user == "bob"])
        runs[overlap] = (carried, core.table.get(beta), core.table.get(model), running)
    for carried, beta, model, running in runs.values():
        assert model.state == "running" and model.trainer == "trainer-1"
        assert carried == [] and beta.state == "queued" and len(running) == 2, (carried, running)
    assert runs[False][1].reason.startswith("waiting for a job of bob to end"), runs[False][1].reason
    reason = runs[True][1].reason
    assert reason.endswith(f"while the policy decided, {runs[True][2].id} ({model_bytes(2) / 2**20:.1f} MiB) started "
                           "on trainer-1: waiting for a job of bob to end: their quota is 2 running at once; it stays "
                           "queued and the next round decides again"), reason
