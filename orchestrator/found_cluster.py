"""Who started the Ray cluster that `--address auto` (the default, or RAY_ADDRESS=auto) found on this machine.

Ray's search for `auto` takes the last `ray start` of the machine, else any cluster whose processes run on it: on a
machine shared by several users (or by several runs of one user) that may be anyone's. Its processes say whose it is:
the raylet runs as the user who started the cluster, its command line names the cluster's GCS address and the
session, whose name ends with the id of the process that started it (`ray start`, or a program's `ray.init`). A
cluster of another user is refused unless named (`--address host:port`); one of this user's is used, and said so
(`ray_cluster.ensure_ray`)."""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class FoundCluster:
    """A running cluster on this machine: its GCS address, the user its raylet runs as, the process that started
    it (its id, and its command line where it still runs)."""

    address: str
    user: str | None
    starter_pid: int | None
    starter: str | None   # the starting process's command line, shortened; None where it has ended

    def describe(self) -> str:
        """'the Ray cluster at ADDRESS, started by user U (process P: COMMAND)'."""
        if self.user is None:
            return f"the Ray cluster at {self.address} (who started it is unknown: none of its processes runs here)"
        process = ""
        if self.starter_pid is not None:
            process = (f" (process {self.starter_pid}: {self.starter})" if self.starter
                       else f" (process {self.starter_pid}, which has ended: a `ray start`, or a program gone since)")
        return f"the Ray cluster at {self.address}, started by user {self.user}{process}"

    def foreign(self) -> bool:
        """Whether another user started it (False where unknown)."""
        return self.user is not None and self.user != current_user()


def current_user() -> str:
    """The user this process runs as (its effective uid's name, as psutil names a process's user)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:   # a uid with no name (a container's): psutil gives its number then
        return str(os.geteuid())


def found_cluster(address: str) -> FoundCluster:
    """Whose cluster answers at `address` (host:port, as Ray's search gives it), from its raylet on this machine."""
    flag = f"--gcs-address={address}"
    for process in psutil.process_iter(["pid", "username", "cmdline"]):
        command = process.info.get("cmdline") or []
        if flag not in command:
            continue
        pid = next((int(found.group(1)) for arg in command if (found := SESSION.search(arg))), None)
        return FoundCluster(address, process.info.get("username"), pid, _command(pid))
    return FoundCluster(address, None, None, None)


# a session's name, in its processes' flags and folders: `session_<date>_<time>_<micros>_<pid of its starter>`
SESSION = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_(\d+)")


def _command(pid: int | None, limit: int = 120) -> str | None:
    """The command line of process `pid`, shortened to `limit` characters; None where it has ended (or is hidden)."""
    if pid is None:
        return None
    try:
        text = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return text if len(text) <= limit else text[:limit - 3] + "..."
