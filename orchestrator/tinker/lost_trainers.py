"""A front's models whose trainer was lost (RemoteCalls, orchestrator/tinker/remote_calls.py): each is placed again
by the scheduler (`tinker.reopen`), created there from its checkpoint, and its calls since that checkpoint sent
again, in order. A model that cannot be placed again within `recover_for_s()` (no trainer with room, its user's
quota; $ASPEN_TINKER_RECOVER_FOR_S, 300 s unset), or whose calls cannot be sent again, is given up: its waiting
calls fail with why, and its job ends `failed` through the scheduler's path for ending an interactive job
(`tinker.close_job`, which closes it on a trainer it was placed on again), its reason the calls' and naming the
last checkpoint kept in its job's folder and its user's newest saved state. Its job once stayed `queued` (or
`running`) for ever: shown by `aspen status`, holding its user's `running` quota, a model nobody could use."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from actors.checkpoint.interactive_state import CHECKPOINT_FOLDER, STATE_FILE

log = logging.getLogger(__name__)

RECOVER_FOR_S = 300.0      # how long a model whose trainer was lost is tried to be placed again, unless set:
RECOVER_FOR_ENV = "ASPEN_TINKER_RECOVER_FOR_S"
RECOVER_EVERY_S = 1.0


def recover_for_s() -> float:
    """How long a front tries to place a lost trainer's model again before it gives it up: $ASPEN_TINKER_RECOVER_FOR_S
    (seconds), else `RECOVER_FOR_S`. Read when the front starts (`aspen http`), so a bad value stops it there."""
    said = os.environ.get(RECOVER_FOR_ENV, "").strip()
    if not said:
        return RECOVER_FOR_S
    try:
        seconds = float(said)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{RECOVER_FOR_ENV}={said!r}: give the seconds a model whose trainer was lost is tried to be "
                         f"placed again before it is given up, a number of 0 or more (unset: {RECOVER_FOR_S:.0f})")
    return seconds


class CallFailed(Exception):
    """A call failed on its trainer: its message, and whether it was the user's ("user") or not ("server")."""

    def __init__(self, message: str, category: str):
        super().__init__(message)
        self.category = category


def kept_checkpoint(output_dir: str, model_id: str) -> str:
    """Where a given-up model's last checkpoint is kept, and its user's newest saved state (a tinker:// path that
    `create_training_client_from_state` loads), said for its job's reason."""
    saved = sorted((folder.stat().st_mtime, folder.name) for folder in (Path(output_dir) / "weights").glob("*")
                   if (folder / STATE_FILE).is_file())
    resume = (f"; its newest saved state, tinker://{model_id}/weights/{saved[-1][1]}, loads in a new training "
              "client (create_training_client_from_state)" if saved else "")
    for name in (CHECKPOINT_FOLDER, f"{CHECKPOINT_FOLDER}.old"):
        folder = Path(output_dir) / name
        if folder.is_dir():
            return f"its last checkpoint is kept in {folder}{resume}"
    return f"it had no checkpoint yet (none in {Path(output_dir) / CHECKPOINT_FOLDER}){resume}"


class LostTrainers:
    """RemoteCalls' part for a lost trainer's models (its attributes: `call`, `lock`, `models`, `waiting`,
    `on_lost`, `recover_for_s`; its `_send`)."""

    call: Any
    lock: Any
    models: dict[str, Any]
    waiting: dict[str, Any]
    on_lost: Any
    recover_for_s: float

    def _send(self, trainer: str, model_id: str, seq_id: int, logged: Any) -> None:  # pragma: no cover - RemoteCalls'
        raise NotImplementedError

    def _lost(self, trainer: str) -> None:
        """`trainer` is gone: its calls' outcomes will not come; its models are placed again (a thread each)."""
        with self.lock:
            waiting = self.waiting.pop(trainer, {})
            models = [(model_id, model) for model_id, model in self.models.items()
                      if model.trainer == trainer and not model.recovering]
            for _, model in models:
                model.recovering = True
        if self.on_lost is not None:
            self.on_lost(trainer, [model_id for model_id, _ in models])
        orphans = [future for future, call in waiting.values() if call is None and not future.done()]
        for future in orphans:   # a sample or a model's end: not sent again
            future.set_exception(CallFailed(f"trainer {trainer} was lost during this call; send it again", "server"))
        for model_id, model in models:
            log.warning("tinker: trainer %s was lost; model %s is placed again from its checkpoint", trainer,
                        model_id)
            threading.Thread(target=self._recover, args=(model_id, model, trainer), name=f"tinker-resume-{model_id}",
                             daemon=True).start()

    def _recover(self, model_id: str, model: Any, lost: str) -> None:
        deadline = time.monotonic() + self.recover_for_s
        while True:
            try:
                placed = self.call("tinker.reopen", model.job, model_id, lost, model.base_model, model.rank,
                                   model.owner, model.seed, model.train_attn, model.train_mlp, model.first_seq,
                                   model.train_unembed)
                break
            except HTTPException as error:
                if error.status_code != 503 or time.monotonic() > deadline:
                    within = (f" within {self.recover_for_s:g}s ({RECOVER_FOR_ENV})" if error.status_code == 503
                              else "")
                    self._give_up(model_id, model, f"it could not be placed again{within} after its trainer {lost} "
                                                   f"was lost: {error.detail}")
                    return
                time.sleep(RECOVER_EVERY_S)
        resumed_from = placed["checkpoint_seq"]
        if resumed_from is not None:   # checkpointed after calls whose answers did not come back before the loss
            with self.lock:
                done = [model.log.pop(seq) for seq in sorted(model.log) if seq <= resumed_from]
            for call in done:
                if not call.future.done():
                    call.future.set_exception(CallFailed(
                        f"this call ran, and model {model_id} was checkpointed after it, but its trainer {lost} was "
                        "lost before its answer came back; the model goes on from that checkpoint", "server"))
        while True:   # the calls after the checkpoint again, in order (and those arriving meanwhile)
            with self.lock:
                model.trainer = placed["trainer"]
                pending = sorted((seq, call) for seq, call in model.log.items()
                                 if not call.sent)
                if not pending:
                    model.recovering = False
                    break
                for _, call in pending:
                    call.sent = True
            try:
                for seq, call in pending:
                    self._send(placed["trainer"], model_id, seq, call)
            except HTTPException as error:
                self._give_up(model_id, model, f"its calls could not be sent again: {error.detail}")
                return
        for call in model.log.values():
            call.sent = False   # (sent again where its trainer is lost next)
        log.info("tinker: model %s resumed on %s from %s", model_id, placed["trainer"],
                 f"its checkpoint after call {resumed_from}" if resumed_from is not None else "its start")

    def _give_up(self, model_id: str, model: Any, why: str) -> None:
        """Fail the model's waiting calls with why, and end its job `failed` with that reason (its last checkpoint
        named), through the scheduler (`close_interactive`): it no longer holds its user's quota as a model nobody
        can use."""
        log.error("tinker: model %s: %s", model_id, why)
        with self.lock:
            self.models.pop(model_id, None)
            calls = list(model.log.values())
        failure = f"model {model_id} was lost: {why}"
        for call in calls:
            if not call.future.done():
                call.future.set_exception(CallFailed(failure, "server"))
        kept = kept_checkpoint(model.output_dir, model_id)
        try:
            self.call("tinker.close_job", model.job, "failed", f"{failure}; {kept}")
        except Exception as error:  # noqa: BLE001 - logged: the job stays until the service ends it
            log.error("tinker: could not end job %s of given-up model %s: %s", model.job, model_id, error)
