"""A trainer fleet without Ray: fake trainers whose calls the test answers, a fake cluster of the nodes the test says
are alive, and a fleet over them whose events go through the real event intake into a real job table
(tests/unit/service/test_trainer_fleet.py; the console's retired trainer in tests/servers/test_console.py)."""

from __future__ import annotations

from actors.service.events.event_intake import EventIntake
from actors.service.scheduler.cluster_plan import NodeInfo
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.trainer_fleet import TrainerCallFailed, TrainerFleet
from tests.helpers.scheduler_fakes import Clock, running_jobs, status

TIMEOUT_S = 30.0
CLUSTER_POLL_S = 5.0
HEAD = NodeInfo(id="head0000aaaa", address="10.0.0.1", cpus=2, gpus=0, head=True)
WORKER = NodeInfo(id="work0000bbbb", address="10.0.0.2", cpus=4, gpus=0)
JOINER = NodeInfo(id="join0000cccc", address="10.0.0.3", cpus=1, gpus=0)


class Call:
    """A call on a fake trainer; the test answers it (or fails it)."""

    def __init__(self) -> None:
        self.answered = False
        self.answer = None
        self.error: Exception | None = None

    def done(self) -> bool:
        return self.answered

    def result(self, timeout: float | None = None):
        if not self.answered and timeout is not None:   # as Ray's get: unanswered within the timeout
            raise TrainerCallFailed("GetTimeoutError", f"no answer in {timeout:.0f} s")
        assert self.answered, "result() of a call that is not done"
        if self.error is not None:
            raise self.error
        return self.answer

    def give(self, answer) -> None:
        self.answered, self.answer = True, answer

    def fail(self, error: Exception) -> None:
        self.answered, self.error = True, error


class FakeTrainer:
    def __init__(self, trainer_id: str, attempt: int, node: str | None, threads: int | None, ram_share: float = 1.0):
        self.trainer_id, self.attempt, self.node, self.threads = trainer_id, attempt, node, threads
        self.ram_share = ram_share
        self.ready = Call()
        self.polls: list[Call] = []
        self.assigned: list[list[tuple]] = []
        self.stops: list[tuple[str, str, str]] = []
        self.last_words = Call()
        self.killed = False

    def answer_poll(self, events=(), jobs=()) -> None:
        self.polls[-1].give((status(self.trainer_id, jobs), list(events)))


class FakeCluster:
    """`TrainerHandles` over fake trainers on the nodes the test says are alive."""

    def __init__(self, *nodes: NodeInfo):
        self.live = list(nodes)
        self.started: list[FakeTrainer] = []   # every trainer launched, in order
        self.autoscaler: object = "none"   # what `autoscaling` answers (placement_waits.Autoscaling), or raises
        self.asked: list[dict] = []   # the demands it was asked of

    def nodes(self, fresh: bool = False) -> list[NodeInfo]:
        return list(self.live)

    def launch(self, trainer_id, attempt, config, node, threads, ram_share=1.0):
        trainer = FakeTrainer(trainer_id, attempt, node, threads, ram_share)
        self.started.append(trainer)
        return trainer, f"svc.{trainer_id}.{attempt}"

    def start(self, handle: FakeTrainer) -> Call:
        return handle.ready

    def poll(self, handle: FakeTrainer) -> Call:
        handle.polls.append(Call())
        return handle.polls[-1]

    def assign(self, handle: FakeTrainer, assignments) -> None:
        handle.assigned.append(assignments)

    def stop_job(self, handle: FakeTrainer, job, kind, reason) -> None:
        handle.stops.append((job, kind, reason))

    def shutdown(self, handle: FakeTrainer) -> Call:
        return handle.last_words

    def kill(self, handle: FakeTrainer) -> None:
        handle.killed = True

    def autoscaling(self, resources: dict) -> str:
        self.asked.append(resources)
        if isinstance(self.autoscaler, Exception):   # the GCS could not be asked (AutoscalingUnknown)
            raise self.autoscaler
        return self.autoscaler

    def current(self, trainer_id: str) -> FakeTrainer:
        return [t for t in self.started if t.trainer_id == trainer_id][-1]


def fleet_with(tmp_path, cluster: FakeCluster, kind: TrainerConfig | list[TrainerConfig] | None = None, **jobs):
    """A fleet following `cluster` (its trainers of `kind`, or of each kind of a list), its intake over a table with
    jobs running on trainer-0."""
    table, core, ids = running_jobs(tmp_path, **jobs)
    clock = Clock()
    intake = EventIntake(table, core, tmp_path / "state", clock=clock)
    kinds = kind if isinstance(kind, list) else [kind or TrainerConfig(nodes="each")]
    fleet = TrainerFleet(kinds, cluster, intake, trainer_timeout_s=TIMEOUT_S,
                         cluster_poll_s=CLUSTER_POLL_S, clock=clock)
    fleet.follow(cluster.nodes(fresh=True))   # a first read made in the call (RayTrainers': the scheduler's own)
    return fleet, intake, table, ids, clock


def bring_up(fleet: TrainerFleet, cluster: FakeCluster) -> None:
    """Every trainer loads its model; the next watch sends each its first poll."""
    for trainer in cluster.started:
        if not trainer.ready.answered:
            trainer.ready.give(status(trainer.trainer_id))
    fleet.watch_all()
    fleet.watch_all()
