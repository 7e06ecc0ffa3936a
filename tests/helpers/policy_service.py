"""A scheduler core and the scheduler actor's loop around it, Ray-free, for the policy fault tests: the same
SchedulerLoop, service lock and round as `SchedulerActor` (`_tick` / `_decide_round`), a fake trainer."""

from __future__ import annotations

import threading
import time

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.scheduler.scheduler_loop import SchedulerLoop
from actors.service.table.job_table import JobTable
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status

LIMIT_S = 0.5


def core_with(policy, tmp_path, names=("alpha", "beta", "gamma"), limit_s: float = LIMIT_S,
              **core) -> tuple[SchedulerCore, list]:
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(name, data, 5) for name in names])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), policy, tmp_path / "state",
                         policy_timeout_s=limit_s, **core)
    return core, core.submit_many(spec.submissions())


def more_jobs(core: SchedulerCore, tmp_path, name: str) -> list:
    spec = run_spec("smollm2-135m", tmp_path / name, [job_dict(name, write_task_data(tmp_path / "data", name), 5)])
    return core.submit_many(spec.submissions())


class ServiceLoop:
    """The scheduler actor's loop around a core, Ray-free: a tick under the service's lock every 0.05 s, each a
    paced decision round (`SchedulerActor._tick` / `_decide_round`); client calls take the same lock."""

    def __init__(self, core: SchedulerCore):
        self.core = core
        self.lock = threading.RLock()
        self.status = fake_status("trainer-0", "smollm2-135m")
        self.rounds: list[list] = []
        self.loop = SchedulerLoop(lambda: self.loop.paced_round(self._round), self.lock, 0.05)

    def _round(self, number: int) -> None:
        self.rounds.append(self.core.plan([self.status], self.loop.unlocked))

    def locked(self, call):
        """`call()` under the service's lock, as a client's call to the actor runs."""
        with self.lock:
            return call()

    def wait_until(self, check, seconds: float = 30.0) -> bool:
        """Whether `check()`, asked under the lock every 0.02 s, came true within `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.locked(check):
                return True
            time.sleep(0.02)
        return False

    def __enter__(self) -> ServiceLoop:
        self.loop.start()
        return self

    def __exit__(self, *exc) -> None:
        self.loop.stop(timeout=10)
