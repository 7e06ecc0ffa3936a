"""Who an HTTP request is, and what of the service it may see: the request's bearer token names a user of
the users file (actors/service/accounts/users.py; read again when it changes, so a removed user or a rotated token is
refused from the next request on), or, while the service has no users file, the service's single token
(`aspen http-token`), which acts as an admin named `admin`.

A user sees and acts on their own jobs and sweeps only: another user's answers exactly as one that does not
exist (404 with the same text), and a name another user's unfinished job or sweep holds is "taken" without
saying whose or in what state. Admins see and act on everything. Ray-free."""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook
from actors.service.table.job_table import AmbiguousJobName, JobRecord

log = logging.getLogger(__name__)

SINGLE_TOKEN_USER = "admin"


@dataclass(frozen=True)
class Caller:
    name: str
    admin: bool
    single: bool = False    # the service's single token (no users file): the operator, as through Ray

    def sees(self, owner: str | None) -> bool:
        return self.admin or owner == self.name

    @property
    def owner(self) -> str | None:
        """What its jobs record as their user: none for the single token (an operator's, as through Ray)."""
        return None if self.single else self.name


class Gate:
    """The callers the server admits: the users file's, or the single token's while there is no users file."""

    def __init__(self, token: str, users: UserBook | None = None):
        self.expected = token.encode()
        self.users = users

    def caller(self, presented: str) -> Caller | None:
        if self.users is not None and self.users.exists():
            user = self.users.authenticate(presented)
            return None if user is None else Caller(user.name, user.admin)
        if secrets.compare_digest(presented.encode(), self.expected):
            return Caller(SINGLE_TOKEN_USER, True, single=True)
        return None

    @property
    def has_users(self) -> bool:
        return self.users is not None and self.users.exists()


def visible(records: Iterable[JobRecord], caller: Caller) -> list[JobRecord]:
    return [record for record in records if caller.sees(record.user)]


def visible_info(info: dict[str, Any], own: set[str]) -> dict[str, Any]:
    """The service's description (`client.info()`) as a user who owns the jobs `own` may see it: each trainer
    with only those of its jobs (`jobs`) and of its last step's token counts (`last_step_job_tokens`); another
    user's job ids (which carry their names) are not revealed there either."""
    trainers = [{**trainer, "jobs": [job for job in trainer.get("jobs", []) if job in own],
                 "last_step_job_tokens": {job: tokens for job, tokens in trainer.get("last_step_job_tokens", {}).items()
                                          if job in own}}
                for trainer in info.get("trainers", [])]
    return {**info, "trainers": trainers}


def find_job(client: Any, caller: Caller, key: str) -> JobRecord:
    """A job by id, or by a name only one of the caller's jobs has; KeyError (404) for another user's job
    with the text an unknown job gets."""
    if caller.admin:
        return client.status(key)
    mine = visible(client.jobs(), caller)
    for record in mine:
        if record.id == key:
            return record
    named = [record for record in mine if record.name == key]
    if len(named) == 1:
        return named[0]
    if named:
        raise AmbiguousJobName(f"{len(named)} jobs are named '{key}' ({', '.join(r.id for r in named)}); give the "
                               "job id")
    raise KeyError(f"no job with id or name '{key}'")


def find_sweep(client: Any, caller: Caller, name: str) -> dict[str, Any]:
    """A sweep's status; KeyError (404) for another user's, with the text an unknown sweep gets."""
    if caller.admin:
        return client.sweep_status(name)
    try:
        status = client.sweep_status(name)
    except KeyError:   # its text lists every sweep's name: this caller's only instead
        status = None
    if status is None or not caller.sees(status.get("user")):
        known = [s["name"] for s in client.sweeps() if caller.sees(s.get("user"))]
        raise KeyError(f"no sweep named '{name}' (sweeps: {', '.join(sorted(known)) or 'none'})")
    return status


class ServiceStateFolder:
    """The state folder whose users file and audit log an HTTP server over a running service reads and writes: the
    service's own (`info()["state_dir"]`, asked on first need and kept), so that `aspen http --address ADDR` sees the
    users `aspen user add --state-dir <the service's folder>` made. A service that cannot be asked yet is the
    caller's 503 (`ask` raises it); a folder the service names that is not on this machine (the server runs
    elsewhere) falls back to `fallback`, said once."""

    def __init__(self, ask: Callable[[], dict], fallback: str | Path = "~/.aspen"):
        self.ask = ask
        self.fallback = Path(fallback).expanduser()
        self.resolved: Path | None = None
        self.lock = threading.Lock()

    def path(self) -> Path:
        with self.lock:
            if self.resolved is None:
                folder = Path(self.ask()["state_dir"]).expanduser()
                if not folder.is_dir():
                    log.warning("aspen http: the service keeps its state in %s, which is not on this machine: users "
                                "and audit are read from %s (give --state-dir where the service's users are)",
                                folder, self.fallback)
                    folder = self.fallback
                self.resolved = folder
            return self.resolved

    def users(self) -> ServiceUsers:
        return ServiceUsers(self)

    def audit(self) -> ServiceAudit:
        return ServiceAudit(self)


class ServiceUsers:
    """A `UserBook` of the service's state folder, found on first use (`ServiceStateFolder`)."""

    def __init__(self, folder: ServiceStateFolder):
        self.folder = folder
        self.book: UserBook | None = None

    def _book(self) -> UserBook:
        if self.book is None:
            self.book = UserBook.in_state_dir(self.folder.path())
        return self.book

    @property
    def path(self) -> Path:
        return self._book().path

    def exists(self) -> bool:
        return self._book().exists()

    def authenticate(self, token: str):
        return self._book().authenticate(token)


class ServiceAudit:
    """An `AuditLog` of the service's state folder, found on first use (`ServiceStateFolder`)."""

    def __init__(self, folder: ServiceStateFolder):
        self.folder = folder

    def record(self, *args: Any, **details: Any) -> None:
        AuditLog.in_state_dir(self.folder.path()).record(*args, **details)

    def rows(self, **filters: Any) -> list[dict]:
        return AuditLog.in_state_dir(self.folder.path()).rows(**filters)
