"""Who else hears what the service does: a small listener interface that the scheduler calls from its
loop (metrics, MQTT events). Listeners must be quick (queue, don't block) and may not hold the scheduler
back: `Listeners` calls each one in turn and logs, rather than raises, what one of them throws."""

from __future__ import annotations

import importlib
import logging
from typing import Any, Protocol

from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus

log = logging.getLogger(__name__)


class ServiceListener(Protocol):
    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        """A job changed state (`previous` is None for a job just submitted)."""

    def job_deleted(self, job_id: str) -> None:
        """A job was deleted from the service (its row is gone). Optional: `Listeners` skips a listener
        that does not define it."""

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        """A trainer's status and what it reported since the last poll: its fused steps (kind `step`,
        one row of its step log each) and its jobs' progress, evaluations, checkpoints and endings."""

    def trainer_retired(self, trainer_id: str) -> None:
        """A trainer is gone for good (its node left the cluster) and everything it reported was heard.
        Optional."""

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        """A scheduling decision: `preempt`, `move`, or `wait_<cause>` (memory, slots, no_trainer, priority,
        other) for a queued job that the policy did not start this round."""

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        """Once per scheduler round: the unfinished jobs (queued, running, paused; on the service's first
        round every job, finished ones too), the number of jobs in each state, and the ready trainers.
        Finished jobs are not passed each round: a table of thousands of them costs a round nothing."""

    def sweeps(self, statuses: list[dict]) -> None:
        """Every sweep's status (`SweepBook.all`), once per scheduler tick while the service has sweeps.
        Optional."""

    def accounts(self, rows: list[dict]) -> None:
        """What each user's jobs used so far, deleted jobs' included (`UsageAccounts.ever_used`: rows of `user`,
        `jobs`, `tokens`, `step_seconds`, `gpu_seconds` that never go down), once per scheduler round. Optional."""

    def describe(self) -> dict[str, str]:
        """Where users reach it, e.g. {"metrics_url": "http://127.0.0.1:9464/metrics"}."""

    def close(self) -> None:
        """The service stops: flush and let go of ports and connections."""


class Listeners:
    """Fans each call out to every listener; one that raises is logged and the rest still hear it."""

    def __init__(self, listeners: list[ServiceListener] | None = None):
        self.listeners = list(listeners or [])

    def add(self, listener: ServiceListener) -> None:
        self.listeners.append(listener)

    def _call(self, method: str, *args: object, optional: bool = False) -> None:
        for listener in self.listeners:
            if optional and not hasattr(listener, method):
                continue
            try:
                getattr(listener, method)(*args)
            except Exception:  # observability must never stop training; the error is logged
                log.exception("listener %s failed in %s", type(listener).__name__, method)

    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        self._call("job_changed", record, previous)

    def job_deleted(self, job_id: str) -> None:
        self._call("job_deleted", job_id, optional=True)

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        self._call("trainer_polled", status, events)

    def trainer_retired(self, trainer_id: str) -> None:
        self._call("trainer_retired", trainer_id, optional=True)

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        self._call("decided", kind, job_id, reason)

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        self._call("tick", jobs, counts, trainers)

    def sweeps(self, statuses: list[dict]) -> None:
        self._call("sweeps", statuses, optional=True)

    def accounts(self, rows: list[dict]) -> None:
        self._call("accounts", rows, optional=True)

    def describe(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for listener in self.listeners:
            found.update(listener.describe())
        return found

    def close(self) -> None:
        self._call("close")


def build_listeners(factory: str | None, config: Any) -> list:
    """The listeners `factory` ('module:function') builds for `config` (the service's `ServiceConfig`); none
    without a factory. Named rather than imported by the scheduler, so that the actors' layer does not depend
    on the user-facing one that holds the metrics and MQTT listeners."""
    if factory is None:
        return []
    module, _, function = factory.partition(":")
    if not module or not function:
        raise ValueError(f"listeners factory '{factory}' is not 'module:function'")
    return list(getattr(importlib.import_module(module), function)(config))
