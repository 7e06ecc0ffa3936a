"""The idempotency keys of `copy_weights` (the SDK sends one `X-Idempotency-Key` with a copy and each of its
retries): a retry answers the first copy's path instead of copying again, also after `aspen http` restarted.

Each copy's run file (`training_run.json`) records its key and when it was made; the server keeps, in memory, the
keys of the last `KEPT_KEYS` copies made within `KEY_TTL_S` (read back from the run files when first needed after
a start), so memory stays bounded on a long-lived server. A key older than that, or pushed out by newer ones,
copies again (the SDK's retries come within minutes)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from orchestrator.tinker import checkpoint_ledger

KEY_TTL_S = 24 * 3600   # how long a copy's key answers its retries
KEPT_KEYS = 10_000      # at most this many keys in memory (the oldest go first)
COPY_RUNS = "copy-*"    # the copies' run folders (copy_routes.py names them)


class CopyKeys:
    """(user, key) -> the copy's path, bounded by `KEY_TTL_S` and `KEPT_KEYS`. Not thread-safe: the copy route
    calls it under its lock."""

    def __init__(self, weights_dir: Path | Callable[[], Path] | None = None,
                 run_file: str = "training_run.json") -> None:
        """`weights_dir`: the folder, or what gives it when first needed (the service's: asked of the service, so
        not while the HTTP server starts, which needs no service to start)."""
        self.weights_dir, self.run_file = weights_dir, run_file
        self.keys: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()   # oldest first
        self.read = weights_dir is None

    def find(self, user: str, key: str) -> str | None:
        """The path of the copy `user` made with `key` within `KEY_TTL_S` (None: none kept)."""
        if not self.read:
            self.read = True
            self._read_run_files()
        self._forget_old()
        kept = self.keys.get((user, key))
        return kept[0] if kept is not None else None

    def add(self, user: str, key: str, path: str, made_at: float) -> None:
        self.keys[user, key] = (path, made_at)
        self.keys.move_to_end((user, key))
        while len(self.keys) > KEPT_KEYS:
            self.keys.popitem(last=False)

    def _forget_old(self) -> None:
        oldest = checkpoint_ledger.now() - KEY_TTL_S
        while self.keys and next(iter(self.keys.values()))[1] <= oldest:
            self.keys.popitem(last=False)

    def _read_run_files(self) -> None:
        """The keys the copies' run files record (the copies made before this server started)."""
        assert self.weights_dir is not None
        folder = Path(self.weights_dir() if callable(self.weights_dir) else self.weights_dir)
        found = []
        for run_file in folder.glob(f"{COPY_RUNS}/{self.run_file}"):
            try:
                facts = json.loads(run_file.read_text())
                found.append((float(facts["copied_at"]), str(facts["user"]), str(facts["idempotency_key"]),
                              str(facts["tinker_path"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue   # a copy made without a key (or before keys were recorded), or a file being written
        for made_at, user, key, path in sorted(found):
            self.add(user, key, path, made_at)
