"""Saved sampler weights sampled after their model has gone from the base: a `tinker://<model>/sampler_weights/
<name>` path outlives its model's session, as Tinker's do. While the model lives, its sampling sessions sample the
frozen copy its save put on the base (TinkerBook.samplers); once the model has ended (its session closed or
stopped beating) or the server restarted, a sampling session on the path reads the saved files back onto a trainer
of their base (`hold`: actors/checkpoint/interactive_state.py's hold_sampler_weights, on the trainer's stepping
thread), and that copy stays while some sampling session samples it: the last session's end takes it off
(`release_session`), as does the checkpoint's deletion or expiry (`drop`). A copy whose trainer died is read
again onto a live one at its next sample (`lost`)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

from actors.service.trainer.interactive_calls import adapter_name

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 120.0   # a trainer reads the files between two of its steps: a long step delays it


@dataclass
class Held:
    """A saved sampler's copy on a trainer: its adapter's name, the trainer (None: this process's), the sampling
    sessions on it."""

    adapter: str
    trainer: str | None
    sessions: set[str] = field(default_factory=set)
    lost: bool = False   # its trainer died: read again at the next sample


class HeldSamplers:
    """The saved samplers read back onto trainers, by tinker:// path (one front's)."""

    def __init__(self, calls: Any):
        self.calls = calls   # InteractiveCalls or RemoteCalls: hold_sampler, remove_adapter
        self.held: dict[str, Held] = {}
        self.reading: dict[str, Future] = {}   # paths being read onto a trainer now: done when they are
        self.lock = threading.Lock()

    def get(self, path: str | None) -> Held | None:
        return self.held.get(path or "")

    def hold(self, path: str, folder: str, base_model: str, sampler_id: str) -> Held:
        """The copy of `path`'s weights (in `folder`) that sampling session `sampler_id` samples, read onto a
        trainer of `base_model` unless one is there already (or being read: then this waits for that read, and
        nothing else waits for either). HTTPException: 422 where the files cannot be read or do not fit the base
        (the answer says which file and why), 503 where no trainer read them in time, or the trainer was lost."""
        while True:
            with self.lock:
                held = self.held.get(path)
                if held is not None and not held.lost:
                    held.sessions.add(sampler_id)
                    return held
                reading = self.reading.get(path)
                mine = reading is None
                if mine:
                    reading = self.reading[path] = Future()
            if not mine:
                reading.result(timeout=HOLD_TIMEOUT_S + 1)   # its failure is this call's too
                continue
            try:
                name = adapter_name(f"{path.removeprefix('tinker://')}@saved")
                trainer = self._read(path, name, folder, base_model)
            except BaseException as error:
                with self.lock:
                    del self.reading[path]
                reading.set_exception(error)
                raise
            with self.lock:
                del self.reading[path]
                self.held[path] = Held(name, trainer, held.sessions if held is not None else set())
            reading.set_result(None)

    def _read(self, path: str, name: str, folder: str, base_model: str) -> str | None:
        """Have a trainer of `base_model` attach the files as `name`; the trainer (None: this process's)."""
        trainer, attached = self.calls.hold_sampler(name, folder, base_model)
        try:
            attached.result(timeout=HOLD_TIMEOUT_S)
        except FutureTimeout:
            raise HTTPException(503, f"{path}: no trainer of {base_model} read its sampler weights within "
                                     f"{HOLD_TIMEOUT_S:.0f}s", headers={"Retry-After": "10"}) from None
        except HTTPException:
            raise
        except Exception as error:  # noqa: BLE001 - the trainer's answer: why the files do not serve, or its loss
            if getattr(error, "category", "user") == "server":
                raise HTTPException(503, f"{path}: {error}", headers={"Retry-After": "5"}) from None
            raise HTTPException(422, f"{path}: {error}") from None
        return trainer

    def release_session(self, session_id: str) -> None:
        """A client session ended: its sampling sessions leave the copies they sampled; a copy no session samples
        any more leaves its trainer."""
        prefix = f"{session_id}:sample:"
        with self.lock:
            for path, held in list(self.held.items()):
                held.sessions = {sampler for sampler in held.sessions if not sampler.startswith(prefix)}
                if not held.sessions:
                    self._take_off(path)

    def drop(self, path: str) -> None:
        """The checkpoint was deleted (by its user, or its time to live passed): its copy leaves its trainer."""
        with self.lock:
            if path in self.held:
                self._take_off(path)

    def lost(self, trainer: str) -> None:
        """`trainer` died with the copies it held: each is read again (onto a live trainer) at its next sample."""
        with self.lock:
            for held in self.held.values():
                if held.trainer == trainer:
                    held.lost = True

    def _take_off(self, path: str) -> None:
        held = self.held.pop(path)
        if held.lost:
            return   # gone with its trainer
        try:
            self.calls.remove_adapter(held.adapter, trainer=held.trainer)
        except HTTPException as error:   # its trainer is gone or busy: a lost trainer took the copy with it
            log.warning("tinker: taking the copy of %s off trainer %s: %s", path, held.trainer, error.detail)
