"""The Tinker API's models held by a running aspen service (`aspen http`): what the routes call, as they call a
trainer's InteractiveCalls in one process, but each model is a job the scheduler entered and placed, and its
calls go to its trainer over the service's client (orchestrator/tinker/tinker_service.py, through the HTTP
server's Ray connection). A call is queued there at once; one poller thread per trainer takes the outcomes of
this front's calls and completes their futures. A session's end finishes its models: each one's final adapter
is written to its job's folder after its last call (what `aspen export` exports) and its job completes.

A trainer that dies takes its models' state with it, not their calls: the front keeps each model's calls since
its last checkpoint (the trainer checkpoints every few optimizer steps and says so with the step's outcome),
and when the trainer is found lost it places the model again (the scheduler picks a trainer with room), creates
it there from that checkpoint and sends those calls again, in order. The user's futures wait meanwhile (the SDK
sees "try again"), and get the answers of the calls sent again: nothing they were answered is lost, and the
state goes on from exactly where it was."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from actors.service.trainer.interactive_commands import SaveSampler
from orchestrator.tinker.lost_trainers import CallFailed, LostTrainers, recover_for_s
from orchestrator.tinker.patient_sends import BUSY_LIMIT_S, PatientSends, category, is_busy
from orchestrator.tinker.tinker_service import LOST_HEADER

log = logging.getLogger(__name__)

POLL_IDLE_S = 0.005        # between takes that brought nothing
TAKE_FAILURES_S = 60.0     # a trainer whose outcomes cannot be taken this long: its waiting calls fail
# An outcome can come back before its call is awaited: the trainer runs a call as soon as it has it, and the
# poller of another call on that trainer may take the outcome before `submit` has the key back and registers it.
# Such an outcome is kept for its call; one that no call claims within this time (its call failed over to
# another trainer, its waiting ended by a failure) is dropped.
UNCLAIMED_S = 600.0


@dataclass
class LoggedCall:
    """A model's call since its last checkpoint: sent again if its trainer is lost."""

    kind: str
    payload: Any
    future: Future
    sent: bool = False   # sent again to the trainer the model was placed on after a loss


@dataclass
class RemoteModel:
    job: str
    trainer: str
    rank: int
    output_dir: str
    base_model: str
    owner: str | None
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    first_seq: int = 1
    train_unembed: bool = False
    log: dict[int, LoggedCall] = field(default_factory=dict)   # seq_id -> call, since the last checkpoint
    recovering: bool = False


def service_caller(link: Any) -> Callable[..., Any]:
    """`call("tinker.submit", *args)` on the service behind an HTTP server's link (its errors as HTTP answers)."""
    from orchestrator.http.bridge import _BridgedClient
    from orchestrator.service_calls import call_service

    def call(method: str, *args: Any) -> Any:
        def request(client: Any) -> Any:
            if isinstance(client, _BridgedClient):   # the Ray connection's process resolves the dotted name
                return getattr(client, method)(*args)
            return reduce(getattr, method.split("."), client)(*args)
        return call_service(link, request)
    return call


class RemoteCalls(LostTrainers):
    """Interactive models on a service's trainers, as one HTTP server (a front) sees them."""

    def __init__(self, call: Callable[..., Any], front: str | None = None):
        self.call = call
        self.sends = PatientSends(call)   # a call to a trainer busy in a long pass goes on in a thread of its own
        self.front = front or f"front-{uuid.uuid4().hex[:12]}"
        self.models: dict[str, RemoteModel] = {}
        # trainer -> key -> (the call's future, its (model id, seq_id) or None)
        self.waiting: dict[str, dict[str, tuple[Future, tuple[str, int] | None]]] = {}
        self.early: dict[str, dict[str, tuple[float, Any]]] = {}   # trainer -> key -> (when, outcome) not awaited yet
        self.pollers: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()
        self.closed = False
        # told (the trainer, its models) when a trainer is found lost, before its models are placed again: the
        # frozen sampler copies that were on it are gone (TinkerBackend.trainer_lost)
        self.on_lost: Callable[[str, list[str]], None] | None = None
        self.recover_for_s = recover_for_s()   # a lost trainer's model tried to be placed again this long

    # -- what the routes call --------------------------------------------------------------------------------
    def bases(self) -> list[str]:
        return self.call("tinker.bases")

    def facts(self, base_model: str) -> dict[str, Any]:
        return self.call("tinker.facts", self.call("tinker.trainer_of_base", base_model))

    def create_model(self, model_id: str, rank: int, *, owner: str | None = None, seed: int = 0,
                     train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1,
                     base_model: str | None = None, train_unembed: bool = False) -> None:
        if model_id in self.models:
            return   # the SDK's retry of the same create
        if base_model is None:
            raise ValueError("a model on the service needs its base model")
        opened = self.call("tinker.open", model_id, base_model, rank, owner, seed, train_attn, train_mlp, first_seq,
                           train_unembed)
        with self.lock:
            self.models[model_id] = RemoteModel(opened["job"], opened["trainer"], rank, opened["output_dir"],
                                                base_model, owner, seed, train_attn, train_mlp, first_seq,
                                                train_unembed)

    def model(self, model_id: str) -> RemoteModel:
        try:
            return self.models[model_id]
        except KeyError:
            raise KeyError(f"no model {model_id}") from None

    def rank_of(self, model_id: str) -> int | None:
        model = self.models.get(model_id)
        return None if model is None else model.rank

    def job_of(self, model_id: str) -> str | None:
        model = self.models.get(model_id)
        return None if model is None else model.job

    def submit(self, model_id: str, seq_id: int, kind: str, payload: Any) -> Future:
        model = self.model(model_id)
        with self.lock:
            logged = model.log.get(seq_id)
            if logged is not None:
                return logged.future   # the SDK's resend of the same call
            logged = model.log[seq_id] = LoggedCall(kind, payload, Future())
            if model.recovering:
                return logged.future   # sent once the model is placed again
            trainer = model.trainer
        try:
            self._send(trainer, model_id, seq_id, logged)
        except HTTPException as error:
            if LOST_HEADER not in (error.headers or {}):
                with self.lock:
                    model.log.pop(seq_id, None)
                raise
            self._lost(trainer)   # the call is sent again where the model is placed next
        return logged.future

    def _send(self, trainer: str, model_id: str, seq_id: int, logged: LoggedCall) -> None:
        """Send a logged call (its first try's errors raised, but a busy trainer's: it is sent on meanwhile)."""
        def refused(error: HTTPException) -> None:   # after a busy answer: the call's own future says why
            if LOST_HEADER in (error.headers or {}):
                self._lost(trainer)   # the call is sent again where the model is placed next
                return
            with self.lock:
                model = self.models.get(model_id)
                if model is not None:
                    model.log.pop(seq_id, None)
            if not logged.future.done():
                logged.future.set_exception(CallFailed(f"trainer {trainer}: {error.detail}", category(error)))

        self.sends.send("tinker.submit", (trainer, self.front, model_id, seq_id, logged.kind, logged.payload),
                        lambda key: self._await(trainer, key, logged.future, (model_id, seq_id)), refused)

    def _queued_send(self, trainer: str, method: str, *args: Any) -> Future:
        """A call to queue work on `trainer` (`method`'s key awaited): its future, failed with why where the call is
        refused after a busy answer (a first try's refusal is raised)."""
        future: Future = Future()

        def sent(key: str) -> None:
            future.aspen_on = (trainer, key)   # type: ignore[attr-defined]  (`cancel`)
            if future.cancelled():   # abandoned by its client while the send waited: cancelled there too
                self.cancel(future)
            self._await(trainer, key, future, None)

        def refused(error: HTTPException) -> None:
            if future.set_running_or_notify_cancel():   # not cancelled meanwhile
                future.set_exception(CallFailed(f"trainer {trainer}: {error.detail}", category(error)))

        self.sends.send(method, (trainer, self.front, *args), sent, refused)
        return future

    def submit_sample(self, call: Any, *, model_id: str | None = None, base_model: str | None = None,
                      trainer: str | None = None) -> Future:
        """A sampling call on the trainer of `model_id`'s sampler, the trainer that holds it (`trainer`), or one
        of `base_model`."""
        if trainer is None:
            trainer = (self.model(model_id).trainer if model_id is not None
                       else self.call("tinker.trainer_of_base", base_model))
        return self._queued_send(trainer, "tinker.sample", call)

    def cancel(self, future: Future) -> bool | None:
        """A sampling call its client abandoned, cancelled on its trainer too: True, dropped there unrun; False, it
        had started (its answer dropped here); None, not there yet (its send cancels it) or its trainer gone."""
        trainer, key = getattr(future, "aspen_on", (None, None))
        if trainer is None:
            return None
        try:
            return bool(self.call("tinker.cancel", trainer, key))
        except HTTPException as error:   # its trainer is gone: nothing runs there to cancel
            log.info("cancelling %s on %s: %s", key, trainer, error.detail)
            return None

    def hold_sampler(self, name: str, folder: str, base_model: str) -> tuple[str, Future]:
        """Attach the sampler weights saved in `folder` as the frozen adapter `name` on a trainer of `base_model`:
        (that trainer, a future done once attached, or failed with why)."""
        trainer = self.call("tinker.trainer_of_base", base_model)
        return trainer, self._queued_send(trainer, "tinker.hold_sampler", name, folder)

    def finish(self, model_id: str, reason: str) -> Future:
        """End a model after its calls: its final adapter written to its job's folder, its job completed."""
        with self.lock:
            model = self.models.pop(model_id, None)
        if model is None:
            raise KeyError(f"no model {model_id}")
        last = SaveSampler(Path(model.output_dir), model.base_model, model_id, model.owner or "", model.output_dir,
                           None)
        try:
            done = self._queued_send(model.trainer, "tinker.finish", model_id, last)
        except HTTPException as error:
            if error.status_code != 404:
                raise
            # not on its trainer any more: its job was cancelled (or ended there), so nothing is left to finish
            raise KeyError(f"no model {model_id}: it had already ended on its trainer ({error.detail})") from None

        def completed(future: Future) -> None:
            error = future.exception()
            try:
                if error is None:
                    self.call("tinker.close_job", model.job, "completed", reason, model.output_dir)
                else:
                    self.call("tinker.close_job", model.job, "failed", f"{reason}; its final save failed: {error}")
            except Exception as failure:  # noqa: BLE001 - logged: the job stays running until the service ends it
                log.error("tinker: could not end job %s of model %s: %s", model.job, model_id, failure)
        done.add_done_callback(completed)
        return done

    def remove_model(self, model_id: str) -> None:
        """A session's model ends (RemoteCalls.finish, with its session's reason)."""
        if model_id in self.models:
            self.finish(model_id, "its session ended")

    def beat(self, model_ids: list[str]) -> None:
        """A session's heartbeat, passed on to its models' trainers (which end a model whose server went silent)."""
        by_trainer: dict[str, list[str]] = {}
        with self.lock:
            for model_id in model_ids:
                model = self.models.get(model_id)
                if model is not None and not model.recovering:
                    by_trainer.setdefault(model.trainer, []).append(model_id)
        for trainer, ids in by_trainer.items():
            try:
                self.call("tinker.beat", trainer, ids)
            except HTTPException as error:   # a trainer lost or busy: its calls' poller deals with it
                log.info("tinker: heartbeat to %s: %s", trainer, error.detail)

    def remove_adapter(self, name: str, model_id: str | None = None, trainer: str | None = None) -> None:
        """Take a frozen sampler copy off its trainer: `trainer`'s, or that of its model `model_id` (none where the
        model has ended: it took its copies with it)."""
        model = self.models.get(model_id or "")
        trainer = trainer or (model.trainer if model is not None else None)
        if trainer is not None:
            self.call("tinker.drop_adapter", trainer, name)

    def close(self) -> None:
        self.closed = True
        self.sends.close()

    # -- outcomes ---------------------------------------------------------------------------------------------
    def _await(self, trainer: str, key: str, future: Future, call: tuple[str, int] | None) -> None:
        """Complete `future` with the outcome of `key` on `trainer`; `call`: the model's call it is (model id,
        seq_id), whose outcome may say the model was checkpointed after it."""
        with self.lock:
            early = self.early.get(trainer, {}).pop(key, None)   # taken before this call had its key back
            if early is None:
                self.waiting.setdefault(trainer, {})[key] = (future, call)
                poller = self.pollers.get(trainer)
                if poller is None or not poller.is_alive():
                    poller = threading.Thread(target=self._poll, args=(trainer,), name=f"tinker-take-{trainer}",
                                              daemon=True)
                    self.pollers[trainer] = poller
                    poller.start()
        if early is not None:
            self._complete(future, call, early[1])

    def _poll(self, trainer: str) -> None:
        failing_since: float | None = None
        busy_since: float | None = None
        while not self.closed:
            with self.lock:
                if not self.waiting.get(trainer):
                    self.pollers.pop(trainer, None)
                    return
            try:
                outcomes = self.call("tinker.take", trainer, self.front)
                failing_since = busy_since = None
            except HTTPException as error:
                if LOST_HEADER in (error.headers or {}):
                    self._lost(trainer)
                    continue
                if is_busy(error):   # alive, in a long pass: the same take is waited on again, nothing failed
                    busy_since = busy_since or time.monotonic()
                    if time.monotonic() - busy_since > BUSY_LIMIT_S:
                        self._fail_all(trainer, CallFailed(f"trainer {trainer}: busy in one pass for over "
                                                           f"{BUSY_LIMIT_S:.0f}s: taken as stuck", "server"))
                    continue
                now = time.monotonic()
                failing_since = failing_since or now
                if error.status_code != 503 or now - failing_since > TAKE_FAILURES_S:
                    self._fail_all(trainer, CallFailed(f"trainer {trainer}: {error.detail}", "server"))
                time.sleep(1.0)
                continue
            for outcome in outcomes:
                with self.lock:
                    future, call = self.waiting.get(trainer, {}).pop(outcome.key, (None, None))
                    if future is None:
                        self._keep_early(trainer, outcome)
                if future is not None:
                    self._complete(future, call, outcome)
            if not outcomes:
                time.sleep(POLL_IDLE_S)

    def _keep_early(self, trainer: str, outcome: Any) -> None:
        """Keep an outcome whose call is not awaited yet (under the lock); drop those unclaimed too long."""
        now = time.monotonic()
        kept = self.early.setdefault(trainer, {})
        for key in [key for key, (when, _) in kept.items() if now - when > UNCLAIMED_S]:
            del kept[key]
        kept[outcome.key] = (now, outcome)

    def _complete(self, future: Future, call: tuple[str, int] | None, outcome: Any) -> None:
        if call is not None and outcome.checkpoint_seq is not None:
            self._checkpointed(*call)
        if future.done():
            return   # a call sent again after its trainer was lost, answered before
        if outcome.error is not None:
            future.set_exception(CallFailed(outcome.error, outcome.category))
        else:
            future.set_result(outcome.value)

    def _fail_all(self, trainer: str, error: Exception) -> None:
        with self.lock:
            waiting = self.waiting.pop(trainer, {})
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(error)

    def _checkpointed(self, model_id: str, seq_id: int) -> None:
        """The model was checkpointed after its call `seq_id`: its calls up to it are not sent again."""
        with self.lock:
            model = self.models.get(model_id)
            if model is not None:
                for seq in [seq for seq in model.log if seq <= seq_id]:
                    del model.log[seq]
                model.first_seq = seq_id + 1
