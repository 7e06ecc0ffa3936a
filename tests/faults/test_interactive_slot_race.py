"""A policy's Start and an interactive model's open on the same trainer at once, the trainer taking one job
(`max_jobs` 1), in the scheduler actor's loop (Ray-free: tests/helpers/policy_service.py). The policy decides on
its round's snapshot with the service's lock released, and a model may open meanwhile. Whichever comes first takes
the slot and the other does not: a model opened while the policy decided keeps it, and the policy's Start made on
the snapshot is not carried out (its job stays queued, its reason naming the model and the limit; the next round
has it wait for a free slot); a Start carried out first keeps it, and the model is refused for now (NoRoom, which
the SDK's create retries), though the trainer does not report the job yet. The trainer never runs two.

The references: the round without the overlap (the model opened before the round's snapshot: the policy has the job
wait for a free slot, as in the overlapped round's end), and the trainer's `max_jobs` against the jobs the service
has running there at every point."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from actors.service.scheduler.interactive_jobs import NoRoom, OverQuota, interactive_submission
from actors.service.scheduler.job_fit import job_adapter_bytes, trainer_view
from policies.base import Decision, Snapshot, Start
from policies.fifo import FifoPolicy
from tests.helpers.policy_service import ServiceLoop, core_with
from tests.helpers.trainer import fake_status

BASE = "smollm2-135m"
TARGETS = ["q_proj", "v_proj"]   # fake_status's layers: what an interactive model with train_attn adapts there
RANK = 256                       # 0.9 MiB on fake_status's layers: seen in a reason's MiB
ONE_SLOT = dataclasses.replace(fake_status("trainer-0", BASE), max_jobs=1)


class Gated(FifoPolicy):
    """FIFO, but its first call answers only once `go` is set (the test changes the service meanwhile)."""

    name = "gated"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.answer: list[Decision] | None = None

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        answer = super().decide(snapshot)
        if self.answer is None and snapshot.queued():
            self.answer = answer
            self.entered.set()
            assert self.go.wait(30), "the test never let the policy answer"
        return answer


def on_trainer(core) -> list[str]:
    return [r.id for r in core.table.all(("running",)) if r.trainer == "trainer-0"]


def race(tmp_path, overlap: bool) -> dict:
    """beta is queued; bob's model opens on the trainer while the round deciding beta waits for the policy
    (`overlap`), or before that round's snapshot. What the round did, and the trainer's jobs at each point."""
    policy = Gated()
    core, (beta,) = core_with(policy, tmp_path, names=("beta",), limit_s=60.0)
    service = ServiceLoop(core)
    service.status = ONE_SLOT
    seen: list[list[str]] = []

    def opens() -> str:   # as the scheduler actor opens one: in a transaction of the table
        with core.table.transaction():
            record = core.interactive.open("s1:train:0", BASE, RANK, "bob", [service.status]).record
        seen.append(on_trainer(core))
        return record.id

    model = None
    if not overlap:   # before the service's first round, which decides beta
        model = opens()
        policy.go.set()
    with service:
        assert policy.entered.wait(30), "the policy was never asked about beta"
        number = service.locked(lambda: len(service.rounds))   # the round deciding beta: not appended yet
        if overlap:
            model = service.locked(opens)
            policy.go.set()
        assert service.wait_until(lambda: len(service.rounds) > number), "the round deciding beta never ended"
        first = service.locked(lambda: (core.table.get(beta.id).state, core.table.get(beta.id).reason))
        seen.append(service.locked(lambda: on_trainer(core)))
        assert service.wait_until(lambda: core.table.get(beta.id).reason.startswith("waiting for a free slot"))
        seen.append(service.locked(lambda: on_trainer(core)))
        carried = service.locked(lambda: [a.job for actions in service.rounds for a in actions])
    return {"model": model, "beta": beta.id, "first": first, "seen": seen, "carried": carried,
            "answer": policy.answer, "core": core}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_model_opened_while_the_policy_decides_keeps_the_one_slot_and_the_policys_start_waits(tmp_path, overlap):
    run = race(tmp_path, overlap)
    model, beta = run["model"], run["beta"]
    assert all(jobs == [model] for jobs in run["seen"]), run["seen"]   # never both: the model alone, throughout
    assert beta not in run["carried"]
    if overlap:
        assert run["answer"] == [Start(beta, "trainer-0")]   # the policy started beta on its snapshot's empty trainer
        lora = interactive_submission("m", BASE, RANK, TARGETS, "bob").job.lora
        need = job_adapter_bytes(lora, trainer_view(ONE_SLOT))
        assert run["first"] == ("queued", (
            f"waiting: the scheduling policy 'gated' started it on trainer-0, but while the policy decided, {model} "
            f"({need / 2**20:.1f} MiB) started on trainer-0: trainer-0 has no free job slot now (it runs 1 jobs, its "
            "max_jobs 1); it stays queued and the next round decides again")), run["first"]
    else:
        assert run["first"][0] == "queued" and run["first"][1].startswith("waiting for a free slot"), run["first"]


def test_a_start_carried_out_first_keeps_the_one_slot_and_the_model_is_refused_for_now(tmp_path):
    policy = Gated()
    core, (beta,) = core_with(policy, tmp_path, names=("beta",), limit_s=60.0)
    service = ServiceLoop(core)
    service.status = ONE_SLOT   # it never reports beta: its job actor still starting
    with service:
        assert policy.entered.wait(30), "the policy was never asked about beta"
        policy.go.set()
        assert service.wait_until(lambda: core.table.get(beta.id).state == "running"), "beta never started"
        with pytest.raises(NoRoom) as refused:
            with service.lock, core.table.transaction():
                core.interactive.open("s1:train:0", BASE, RANK, "bob", [service.status])
        running = service.locked(lambda: on_trainer(core))
    assert running == [beta.id]
    assert not isinstance(refused.value, OverQuota)
    assert "trainer-0 runs 1 jobs, its max_jobs (1)" in str(refused.value), str(refused.value)
