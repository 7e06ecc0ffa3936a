"""What the Tinker SDK asks to keep with a checkpoint beyond its files: its time to live (`ttl_seconds` at its
save, or set later: it is deleted once that has passed), the user's metadata (`user_metadata`) and whether its
owner published it (other users may then load and sample it), by tinker:// path, in one JSON file in the weights
folder (written durably), so that a restarted server still deletes, lists and shares them as asked. A checkpoint
saved again under its path starts afresh (not published, its new save's time to live).

`due` gives the checkpoints whose time has passed and are not yet deleted (the backend deletes their files and
drops their frozen sampler copies: tinker_routes.py); `gone_note` says, for a path its owner asks for later, when
it expired or when they deleted it (a deletion leaves a mark, kept as the rest, until a save under that path
again). Each entry names its owner (the user who saved, set, published or deleted it): to another user a deleted or
expired path is answered as one that never existed (it was theirs to know of only while it was published). Entries
written before entries named their owner are given one once, when the ledger is read (`_attribute`, said in the
log): the user the checkpoint's own files name, else its run's (training_run.json, another of its checkpoints);
one whose run's files are all gone keeps none, and its path is to everyone one that never existed (its time to
live and publishing still apply to nothing). The clock is `now` (seconds since the epoch), which tests may move."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from actors.checkpoint.interactive_state import STATE_FILE
from actors.checkpoint.peft_names import METADATA_NAME
from actors.service.scheduler.interactive_jobs import model_folder
from actors.storage.durable import write_durably

LEDGER_NAME = "checkpoint_ledger.json"
MIN_TTL_S = 3600                     # the SDK's documented range: 1 hour ..
MAX_TTL_S = 10 * 365 * 24 * 3600     # .. 10 years
now = time.time
log = logging.getLogger(__name__)


def ttl_problem(ttl_seconds: int | None) -> str | None:
    """Why `ttl_seconds` is not one the API takes, or None."""
    if ttl_seconds is None or MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        return None
    return (f"ttl_seconds is {ttl_seconds}: a checkpoint's time to live is between {MIN_TTL_S} (1 hour) and "
            f"{MAX_TTL_S} (10 years) seconds, or none (it never expires)")


def _when(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class CheckpointLedger:
    """The ledger of one weights folder; safe to use from the request threads and the backend's reaper."""

    def __init__(self, weights_dir: Path):
        self.path = Path(weights_dir) / LEDGER_NAME
        self.lock = threading.Lock()
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                self.entries = json.loads(self.path.read_text())
            except ValueError as error:
                raise ValueError(f"{self.path}: not the checkpoint ledger aspen writes ({error}); move it aside "
                                 "(the checkpoints' times to live and metadata are then forgotten)") from None
            self._attribute(Path(weights_dir))

    def _attribute(self, weights_dir: Path) -> None:
        """Give each entry written before entries named their owner the user its files name (`owner_in_files`;
        none found: null, no user's), once: the ledger is written again and the log says how many, and which
        found none."""
        older = [path for path, entry in self.entries.items() if "owner" not in entry]
        if not older:
            return
        for path in older:
            self.entries[path]["owner"] = owner_in_files(weights_dir, path)
        unknown = [path for path in older if self.entries[path]["owner"] is None]
        self._write()
        log.warning("%s: %d entries written before entries named their owner now name the user their checkpoint's "
                    "or run's files name%s", self.path, len(older) - len(unknown),
                    f"; {len(unknown)} whose run's files are gone name none: to every user they are paths that "
                    f"never existed ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})"
                    if unknown else "")

    def _write(self) -> None:
        write_durably(self.path, json.dumps(self.entries, indent=1, sort_keys=True))

    def record(self, path: str, ttl_seconds: int | None, user_metadata: dict[str, str] | None, owner: str) -> None:
        """A checkpoint saved at `path` by `owner` (again: its earlier entry replaced, as the SDK's overwrite
        replaces)."""
        entry: dict[str, Any] = {}
        if ttl_seconds is not None:
            entry["expires_at"] = now() + ttl_seconds
        if user_metadata:
            entry["user_metadata"] = dict(user_metadata)
        if entry:
            entry["owner"] = owner
        with self.lock:
            self._put(path, entry)

    def _put(self, path: str, entry: dict[str, Any]) -> None:
        """(The lock held.) `path`'s entry is `entry` now (none where it keeps nothing), written if it changed."""
        if entry == self.entries.get(path, {}):
            return
        if entry:
            self.entries[path] = entry
        else:
            del self.entries[path]
        self._write()

    def set_ttl(self, path: str, ttl_seconds: int | None, owner: str) -> None:
        """Its owner's checkpoint expires `ttl_seconds` from now (None: never)."""
        with self.lock:
            entry = {key: value for key, value in self.entries.get(path, {}).items() if key != "expires_at"}
            if ttl_seconds is not None:
                entry["expires_at"] = now() + ttl_seconds
                entry["owner"] = owner
            self._put(path, entry)

    def public(self, path: str) -> bool:
        """Whether its owner published it (and it is not deleted)."""
        entry = self.entries.get(path, {})
        return bool(entry.get("public")) and not entry.get("deleted")

    def set_public(self, path: str, public: bool, owner: str) -> bool:
        """Its owner publishes (or makes private again) the checkpoint; False where it was so already."""
        with self.lock:
            entry = dict(self.entries.get(path, {}))
            if bool(entry.get("public")) == public:
                return False
            if public:
                entry["public"] = True
                entry["owner"] = owner
            else:
                entry.pop("public")
            self._put(path, entry)
            return True

    def forget(self, path: str, owner: str) -> None:
        """The checkpoint was deleted by its user, `owner`: its settings go, a mark of when and whose stays
        (`gone_note` reads it)."""
        with self.lock:
            self._put(path, {"deleted_by_owner_at": now(), "owner": owner})

    def expires_at(self, path: str) -> datetime | None:
        entry = self.entries.get(path, {})
        return _when(entry["expires_at"]) if "expires_at" in entry else None

    def user_metadata(self, path: str) -> dict[str, str] | None:
        return self.entries.get(path, {}).get("user_metadata")

    def due(self) -> list[str]:
        """The checkpoints whose time has passed and that are not yet deleted (`deleted` after deleting them)."""
        moment = now()
        with self.lock:
            return [path for path, entry in self.entries.items()
                    if entry.get("expires_at", float("inf")) <= moment and not entry.get("deleted")]

    def deleted(self, path: str) -> None:
        with self.lock:
            self.entries[path]["deleted"] = True
            self._write()

    def gone(self, path: str) -> bool:
        """Whether its owner deleted it or its time has passed."""
        entry = self.entries.get(path, {})
        return "deleted_by_owner_at" in entry or entry.get("expires_at", float("inf")) <= now()

    def gone_note(self, path: str, user: str) -> str | None:
        """For `user`, the checkpoint's owner: "<path> was deleted at <when>" for a checkpoint they deleted,
        "<path> expired at <when> (its ttl_seconds)" for one whose time has passed, with what to do; None for any
        other, and for every other user (to whom it is as a path that never existed)."""
        entry = self.entries.get(path, {})
        if entry.get("owner") != user:
            return None
        if "deleted_by_owner_at" in entry:
            instead = ("save_weights_for_sampler again, or open a sampling client on another checkpoint"
                       if "/sampler_weights/" in path else "save_state again, or load another checkpoint")
            return (f"{path} was deleted by its owner (delete_checkpoint) at "
                    f"{_when(entry['deleted_by_owner_at']).isoformat(timespec='seconds')}; {instead}")
        if entry.get("expires_at", float("inf")) > now():
            return None
        return (f"{path} expired at {_when(entry['expires_at']).isoformat(timespec='seconds')} (the ttl_seconds it "
                "was saved with) and was deleted; save it again, with a longer ttl_seconds or none")


def owner_in_files(weights_dir: Path, path: str) -> str | None:
    """The user a checkpoint's files name (`tinker://<model>/<kind>/<name>`): its own facts file's, else its
    run's (training_run.json, written by rest_routes.py), else another checkpoint's of its run; None where all
    are gone."""
    model_id, _, rest = path.removeprefix("tinker://").partition("/")
    run = model_folder(weights_dir, model_id)
    if not model_id or not run.is_dir():
        return None
    candidates = [run / rest / STATE_FILE, run / rest / METADATA_NAME, run / "training_run.json",
                  *sorted(run.glob(f"*/*/{STATE_FILE}")), *sorted(run.glob(f"*/*/{METADATA_NAME}"))]
    for facts_file in candidates:
        try:
            user = json.loads(facts_file.read_text()).get("user")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(user, str) and user:
            return user
    return None
