"""A handle on one submitted job, shared by the Ray client (orchestrator/client.py) and the HTTP client
(orchestrator/http_client.py): it asks its client, whichever it is (this module imports neither Ray nor
an HTTP library)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from actors.service.job_table import JobRecord


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
