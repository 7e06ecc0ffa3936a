"""The Tinker API's backend, what every route serves: the models' calls (a trainer's InteractiveCalls in this
process, or RemoteCalls: a running service's trainers), where saves are written, who a key is, the client
sessions, and the front's book of models, samplers and sampling sessions; its reaper ends the sessions that stopped
beating and deletes the checkpoints whose time to live has passed."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.service.scheduler.interactive_jobs import model_folder
from actors.service.trainer.interactive_calls import InteractiveCalls
from orchestrator.tinker.checkpoint_ledger import CheckpointLedger
from orchestrator.tinker.held_samplers import HeldSamplers
from orchestrator.tinker.remote_calls import RemoteCalls
from orchestrator.tinker.sessions import Session, Sessions

REAP_EVERY_S = 1.0    # how often sessions that stopped beating are looked for
MAX_EPHEMERAL = 8     # a model's ephemeral sampler copies kept on its trainer (an RL loop makes one a step)
FIND_FOLDER_EVERY_S = 30.0   # how often the reaper asks a service for the weights folder until it is known
log = logging.getLogger(__name__)


@dataclass
class TinkerBook:
    """What the front knows of the models and samplers it serves: each training model's user and base, each
    saved sampler path's frozen copy, each sampling session's adapter, user, path and base."""

    owners: dict[str, str] = field(default_factory=dict)          # model id -> its user
    model_bases: dict[str, str] = field(default_factory=dict)     # model id -> its base
    sampler_bases: dict[str, str] = field(default_factory=dict)   # sampling session id -> its base
    # tinker:// path -> (snapshot adapter, user): the frozen copies saves put on the base while their model lives
    # (after it, the saved files are read back: TinkerBackend.held)
    samplers: dict[str, tuple[str, str]] = field(default_factory=dict)
    # model id -> its ephemeral samplers' paths (save_weights_and_get_sampling_client), the oldest first; and the
    # paths of those no longer on the base -> why (a model keeps its MAX_EPHEMERAL newest; none outlives its model)
    ephemeral: dict[str, list[str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    sampling_sessions: dict[str, tuple[str | None, str, str | None]] = field(default_factory=dict)
    # ^ sampling session id -> (its adapter, its user, the path it samples)
    # the sampling sessions on another user's published path: each sample looks again (the ledger, in memory)
    borrowed: set[str] = field(default_factory=set)


class TinkerBackend:
    """What the routes serve: the models' calls (a trainer's InteractiveCalls in this process, serving one base
    under the name `base_model`; or RemoteCalls, a running service's trainers and their bases), where saves are
    written (each model's folder in `weights_dir`), and who a key is."""

    def __init__(self, calls: InteractiveCalls | RemoteCalls, base_model: str | None,
                 weights_dir: Path | Callable[[], Path], authenticate: Callable[[str], str | None]):
        """`weights_dir`: a folder, or how to find it when first needed (a service's, asked of it)."""
        self.calls = calls
        self.local = isinstance(calls, InteractiveCalls)
        if self.local and base_model is None:
            raise ValueError("a backend over one trainer's calls needs the name users give its base (base_model)")
        self.base_model = base_model
        self._weights_dir = weights_dir
        self.authenticate = authenticate
        self.sessions = Sessions()
        self.book = TinkerBook()
        self.thread = (threading.Thread(target=calls.run, name="tinker-calls", daemon=True)
                       if isinstance(calls, InteractiveCalls) else None)
        self.stopping = threading.Event()
        self.reaper = threading.Thread(target=self._reap, name="tinker-sessions", daemon=True)
        self._ledger: CheckpointLedger | None = None
        self.held = HeldSamplers(calls)   # saved samplers read back onto a trainer after their model ended
        if isinstance(calls, RemoteCalls):
            calls.on_lost = self.trainer_lost

    def start(self) -> TinkerBackend:
        if self.thread is not None:
            self.thread.start()
        self.reaper.start()
        return self

    @property
    def weights_dir(self) -> Path:
        return Path(self._weights_dir() if callable(self._weights_dir) else self._weights_dir)

    @property
    def ledger(self) -> CheckpointLedger:
        """The checkpoints' times to live and metadata (checkpoint_ledger.py), read when first needed."""
        if self._ledger is None:
            self._ledger = CheckpointLedger(self.weights_dir)
        return self._ledger

    def sweep_expired(self) -> None:
        """Delete the checkpoints whose time to live has passed: their files, and a sampler path's frozen copy on
        the base with the sampling sessions on it."""
        for path in self.ledger.due():
            model_id, kind, name = path.removeprefix("tinker://").split("/", 2)
            shutil.rmtree(self.folder(model_id) / kind / name, ignore_errors=True)
            self.forget_sampler(path)
            self.ledger.deleted(path)
            log.info("tinker checkpoint %s expired (its ttl_seconds) and was deleted", path)

    def forget_sampler(self, path: str) -> None:
        """A checkpoint was deleted: a sampler's copy leaves the base (its model's frozen one, or the one read back
        from its files). The sampling sessions on it stay known: their samples are refused saying it was deleted
        (the ledger's `gone_note`), not that no such session is theirs."""
        live = self.book.samplers.pop(path, None)
        if live is not None:
            with contextlib.suppress(KeyError):   # its model closed meanwhile, the copy with it
                self.calls.remove_adapter(live[0], path.removeprefix("tinker://").split("/")[0])
        self.held.drop(path)

    def keep_ephemeral(self, model_id: str, path: str) -> None:
        """An ephemeral save's copy joins its model's; beyond the MAX_EPHEMERAL newest, the oldest leaves the base
        (sampling it then says so: `dropped_note`). Files of none are written."""
        kept = self.book.ephemeral.setdefault(model_id, [])
        if path not in kept:
            kept.append(path)
        while len(kept) > MAX_EPHEMERAL:
            old = kept.pop(0)
            self.book.dropped[old] = (f"a model keeps the copies of its {MAX_EPHEMERAL} newest ephemeral saves; "
                                      "sample through a newer client")
            live = self.book.samplers.pop(old, None)
            if live is not None:
                self.calls.remove_adapter(live[0], model_id)

    def dropped_note(self, path: str | None) -> str | None:
        """Why an ephemeral sampler's weights are no longer sampled, or None."""
        why = self.book.dropped.get(path or "")
        if why is None:
            return None
        return (f"the weights of this sampling client ({path}, from save_weights_and_get_sampling_client) are no "
                f"longer on the base: {why}, or save with a name (save_weights_for_sampler) to keep them")

    def trainer_lost(self, trainer: str, model_ids: list[str]) -> None:
        """A service's trainer died: the frozen sampler copies of its models (placed again elsewhere from their
        checkpoints) and the copies read back onto it are gone with it; their sampling sessions go on, on copies
        read from the saved files (onto a live trainer, at their next sample)."""
        for path in list(self.book.samplers):
            if path.removeprefix("tinker://").split("/")[0] in model_ids:
                del self.book.samplers[path]
        for model_id in model_ids:   # ephemeral ones have no files to read back
            for path in self.book.ephemeral.pop(model_id, []):
                self.book.dropped[path] = f"its trainer {trainer} was lost, and ephemeral weights are not saved"
        self.held.lost(trainer)

    def bases(self) -> list[str]:
        """The base models served."""
        return [self.base_model or ""] if self.local else self.calls.bases()

    def facts(self, base_model: str) -> dict[str, Any]:
        """A base's context length, architecture and end-of-sequence token."""
        return self.calls.facts() if self.local else self.calls.facts(base_model)

    def folder(self, model_id: str) -> Path:
        return model_folder(self.weights_dir, model_id)

    def end_session(self, session: Session, reason: str = "its session ended") -> None:
        """A session ended (closed, or stopped beating): its models leave the base, and the copies of their
        sampler weights (the files stay); its sampling sessions end, and a copy read back from saved files that no
        session samples any more leaves its trainer; on a service, each model's job completes with its final
        adapter."""
        session.ended = True
        prefix = f"{session.session_id}:sample:"
        for sampler_id in [sampler_id for sampler_id in self.book.sampling_sessions if sampler_id.startswith(prefix)]:
            del self.book.sampling_sessions[sampler_id]
            self.book.sampler_bases.pop(sampler_id, None)
            self.book.borrowed.discard(sampler_id)
        self.held.release_session(session.session_id)
        for model_id in session.models:
            for path in self.book.ephemeral.pop(model_id, []):   # not saved: they end with their model
                self.book.dropped[path] = "its model ended, and ephemeral weights are not saved; train again"
            for path, (adapter, _) in list(self.book.samplers.items()):
                if path.startswith(f"tinker://{model_id}/"):
                    self.calls.remove_adapter(adapter, model_id)
                    del self.book.samplers[path]
            try:
                if self.local:
                    self.calls.remove_model(model_id)
                else:
                    self.calls.finish(model_id, reason)
            except KeyError:
                continue   # closed already

    def _reap(self) -> None:
        next_find = 0.0
        while not self.stopping.wait(REAP_EVERY_S):
            if self._ledger is None and time.monotonic() >= next_find:
                # a service's weights folder is asked of it: by a request or by this thread, whichever comes first
                # (a restarted front deletes what expired meanwhile without waiting for a request), not more
                # often than FIND_FOLDER_EVERY_S while the service does not answer
                next_find = time.monotonic() + FIND_FOLDER_EVERY_S
                try:
                    _ = self.ledger
                except Exception as error:  # noqa: BLE001 - said, and tried again later; requests raise it
                    log.warning("tinker: the weights folder is not known yet (%s); checkpoints whose time to live "
                                "passed are deleted once it is", error)
            try:
                if self._ledger is not None:
                    self.sweep_expired()
            except Exception:   # the reaper goes on; the next request sweeps again and raises it to its caller
                log.exception("deleting the expired tinker checkpoints failed")
            for session in self.sessions.expired():
                log.info("tinker session %s of %s stopped beating; its models are closed", session.session_id,
                         session.user)
                self.end_session(session, "its session stopped beating")

    def close(self) -> None:
        self.stopping.set()
        self.calls.close()
        if self.thread is not None:
            self.thread.join(timeout=30)
