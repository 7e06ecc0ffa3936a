"""The audit log of a shared service: who did what, when. One JSON line per action (`time`, `user`, `action`,
`target`, and the action's details), appended to `<state_dir>/audit.jsonl` (mode 0600) with O_APPEND and
fsync, so that concurrent writers (the HTTP API, `aspen user`) never interleave or lose a line and a line
once written is never rewritten. Written for job and sweep submissions, cancels, pauses, resumes and for user
changes; read by admins (`GET /v1/audit`). Ray-free."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from actors.storage.durable import append_record

AUDIT_FILE = "audit.jsonl"


class AuditLog:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()

    @classmethod
    def in_state_dir(cls, state_dir: str | Path) -> AuditLog:
        return cls(Path(state_dir).expanduser() / AUDIT_FILE)

    def record(self, user: str, action: str, target: str, **details: Any) -> dict[str, Any]:
        """Append one line; an OSError (a full disk) propagates: an action that cannot be audited is not done."""
        row = {"time": round(time.time(), 3), "user": user, "action": action, "target": target, **details}
        append_record(self.path, (json.dumps(row, sort_keys=False, default=str) + "\n").encode(), private=True)
        return row

    def rows(self, *, user: str | None = None, after: float | None = None, limit: int = 10_000) -> list[dict]:
        """The newest `limit` rows (oldest first), of `user` only and after the time `after` where given."""
        if not self.path.is_file():
            return []
        found = []
        with self.path.open() as lines:
            for number, line in enumerate(lines, start=1):
                if not line.endswith("\n"):   # a line being written right now: not yet part of the log
                    break
                try:
                    row = json.loads(line)
                except ValueError:
                    raise ValueError(f"{self.path}:{number}: not a JSON line; the log was edited by hand") from None
                if (user is None or row.get("user") == user) and (after is None or row.get("time", 0) > after):
                    found.append(row)
        return found[-limit:]
