"""A handle on one submitted job, shared by the Ray client (orchestrator/client.py) and the HTTP client
(orchestrator/http/api_client.py): it asks its client, whichever it is (this module imports neither Ray nor
an HTTP library)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from actors.service.table.job_table import TERMINAL_STATES, JobRecord


class JobControl(Protocol):
    """What a handle asks of its client."""

    def status(self, job: str) -> JobRecord: ...

    def wait(self, job: str, timeout: float | None = None) -> JobRecord: ...

    def cancel(self, job: str) -> JobRecord: ...

    def losses(self, job: str) -> list[dict[str, Any]]: ...


class JobHandle:
    """A submitted job: its id and name, and its status, wait, cancel and losses through its client."""

    def __init__(self, client: JobControl, job_id: str, name: str):
        self.client = client
        self.id = job_id
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def status(self) -> JobRecord:
        return self.client.status(self.id)

    def wait(self, timeout: float | None = None) -> JobRecord:
        return self.client.wait(self.id, timeout)

    def cancel(self) -> JobRecord:
        return self.client.cancel(self.id)

    def losses(self) -> list[dict[str, Any]]:
        """One row per optimizer step: step, loss, tokens, lr, grad_norm, eval_loss (where evaluated)."""
        return self.client.losses(self.id)


def wait_until_ended(status: Callable[[str], JobRecord], job: str, timeout: float | None = None,
                     poll: float = 0.5) -> JobRecord:
    """Ask `status(job)` every `poll` seconds until the job has ended (completed, stopped early, failed or
    cancelled); TimeoutError naming its state and reason after `timeout` seconds."""
    deadline = None if timeout is None else time.time() + timeout
    while True:
        record = status(job)
        if record.state in TERMINAL_STATES:
            return record
        if deadline is not None and time.time() > deadline:
            raise TimeoutError(f"job {record.id} is still {record.state} ({record.reason}) after {timeout}s")
        time.sleep(poll)
