"""The trainers' side, as the Ray-free trainer fleet (`trainer_fleet.py`) uses it: its calls on a trainer and how
they fail.

Also what the fleet asks of the cluster (its live nodes, what its autoscaler says of a demand). On Ray,
`actors/ray_trainers.py` provides it; the tests' fakes (tests/helpers/fleet_fakes.py) stand in for it."""

from __future__ import annotations

from typing import Any, Protocol

from actors.service.scheduler.cluster_plan import NodeInfo
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.placement_waits import Autoscaling
from actors.service.trainer.job_link import Assignment
from actors.spec.job_spec import JobSpec


class TrainerCallFailed(RuntimeError):
    """A call on a trainer failed: `kind` names the failure (the Ray error's class), `cause` what it was."""

    def __init__(self, kind: str, cause: object):
        super().__init__(f"{kind}: {cause}")
        self.kind = kind
        self.cause = cause


class TrainerUnavailable(TrainerCallFailed):
    """The trainer did not answer for now (its node may be dying, or the network hiccupped): ask again."""


class TrainerCall(Protocol):
    """A call on a trainer under way."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any:
        """Its answer; raises `TrainerCallFailed` (`TrainerUnavailable` for a trainer that may come back)."""


class TrainerHandles(Protocol):
    """The trainers' side, as the fleet uses it (on Ray: `actors/ray_trainers.py`)."""

    def nodes(self, fresh: bool = False) -> list[NodeInfo] | None:
        """The cluster's live nodes, the head first: as last read (`fresh`: read now, waiting on the cluster); None
        while the first read has not answered (never with `fresh`)."""

    def launch(self, trainer_id: str, attempt: int, config: TrainerConfig, node: str | None,
               threads: int | None, ram_share: float = 1.0) -> tuple[Any, str]:
        """Start a trainer (pinned to `node` unless None); its handle and its actor's name. `ram_share`: a CPU
        trainer's share of its node's RAM for its default memory budget (cluster_plan.py)."""

    def start(self, handle: Any) -> TrainerCall:
        """Load its model; answers its first `TrainerStatus`."""

    def poll(self, handle: Any) -> TrainerCall:
        """Answers (status, events since the last poll)."""

    def assign(self, handle: Any, assignments: list[Assignment]) -> None: ...

    def stop_job(self, handle: Any, job: str, kind: str, reason: str) -> None: ...

    def generate(self, handle: Any, job: str, prompt: str, max_new_tokens: int, ticket: str | None) -> TrainerCall:
        """Continue `prompt` by the job's adapter and by the base alone, between two of its steps; `ticket`: the
        call's in `TrainerFleet.tries` (the trainer runs it only while it is still waited for)."""

    def try_saved(self, handle: Any, job: str, spec: JobSpec, location: str, step: int, prompt: str,
                  max_new_tokens: int, ticket: str | None) -> TrainerCall:
        """Continue `prompt` by the adapter a finished job saved at `location` and by the base alone."""

    def shutdown(self, handle: Any) -> TrainerCall:
        """Pause its jobs with a checkpoint and stop; answers its last events."""

    def kill(self, handle: Any) -> None:
        """End it now; raises `TrainerCallFailed` if that could not be done."""

    def autoscaling(self, resources: dict[str, float]) -> Autoscaling:
        """Whether Ray still holds an actor's demand of `resources` pending, and if so what the cluster's autoscaler
        says of it (placement_waits.py)."""
