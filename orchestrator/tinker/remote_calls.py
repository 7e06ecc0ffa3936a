"""The Tinker API's models held by a running aspen service (`aspen http`): what the routes call, as they call a
trainer's InteractiveCalls in one process, but each model is a job the scheduler entered and placed, and its
calls go to its trainer over the service's client (orchestrator/tinker/tinker_service.py, through the HTTP
server's Ray connection). A call is queued there at once; one poller thread per trainer takes the outcomes of
this front's calls and completes their futures. A session's end finishes its models: each one's final adapter
is written to its job's folder after its last call (what `aspen export` exports) and its job completes."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from actors.service.trainer.interactive_commands import SaveSampler

log = logging.getLogger(__name__)

POLL_IDLE_S = 0.005        # between takes that brought nothing
TAKE_FAILURES_S = 60.0     # a trainer whose outcomes cannot be taken this long: its waiting calls fail


class CallFailed(Exception):
    """A call failed on its trainer: its message, and whether it was the user's ("user") or not ("server")."""

    def __init__(self, message: str, category: str):
        super().__init__(message)
        self.category = category


@dataclass
class RemoteModel:
    job: str
    trainer: str
    rank: int
    output_dir: str
    base_model: str
    owner: str | None


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


class RemoteCalls:
    """Interactive models on a service's trainers, as one HTTP server (a front) sees them."""

    def __init__(self, call: Callable[..., Any], front: str | None = None):
        self.call = call
        self.front = front or f"front-{uuid.uuid4().hex[:12]}"
        self.models: dict[str, RemoteModel] = {}
        self.waiting: dict[str, dict[str, Future]] = {}      # trainer -> key -> the call's future
        self.pollers: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()
        self.closed = False

    # -- what the routes call --------------------------------------------------------------------------------
    def bases(self) -> list[str]:
        return self.call("tinker.bases")

    def facts(self, base_model: str) -> dict[str, Any]:
        return self.call("tinker.facts", self.call("tinker.trainer_of_base", base_model))

    def create_model(self, model_id: str, rank: int, *, owner: str | None = None, seed: int = 0,
                     train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1,
                     base_model: str | None = None) -> None:
        if model_id in self.models:
            return   # the SDK's retry of the same create
        if base_model is None:
            raise ValueError("a model on the service needs its base model")
        opened = self.call("tinker.open", model_id, base_model, rank, owner, seed, train_attn, train_mlp, first_seq)
        with self.lock:
            self.models[model_id] = RemoteModel(opened["job"], opened["trainer"], rank, opened["output_dir"],
                                                base_model, owner)

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
        return self._queued(model.trainer, self.call("tinker.submit", model.trainer, self.front, model_id, seq_id,
                                                     kind, payload))

    def submit_sample(self, call: Any, *, model_id: str | None = None, base_model: str | None = None) -> Future:
        trainer = (self.model(model_id).trainer if model_id is not None
                   else self.call("tinker.trainer_of_base", base_model))
        return self._queued(trainer, self.call("tinker.sample", trainer, self.front, call))

    def finish(self, model_id: str, reason: str) -> Future:
        """End a model after its calls: its final adapter written to its job's folder, its job completed."""
        with self.lock:
            model = self.models.pop(model_id, None)
        if model is None:
            raise KeyError(f"no model {model_id}")
        last = SaveSampler(Path(model.output_dir), model.base_model, model_id, model.owner or "", model.output_dir,
                           None)
        done = self._queued(model.trainer, self.call("tinker.finish", model.trainer, self.front, model_id, last))

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

    def remove_adapter(self, name: str, model_id: str | None = None) -> None:
        model = self.models.get(model_id or "")
        if model is not None:
            self.call("tinker.drop_adapter", model.trainer, name)

    def close(self) -> None:
        self.closed = True

    # -- outcomes ---------------------------------------------------------------------------------------------
    def _queued(self, trainer: str, key: str) -> Future:
        future: Future = Future()
        with self.lock:
            self.waiting.setdefault(trainer, {})[key] = future
            poller = self.pollers.get(trainer)
            if poller is None or not poller.is_alive():
                poller = threading.Thread(target=self._poll, args=(trainer,), name=f"tinker-take-{trainer}",
                                          daemon=True)
                self.pollers[trainer] = poller
                poller.start()
        return future

    def _poll(self, trainer: str) -> None:
        failing_since: float | None = None
        while not self.closed:
            with self.lock:
                if not self.waiting.get(trainer):
                    self.pollers.pop(trainer, None)
                    return
            try:
                outcomes = self.call("tinker.take", trainer, self.front)
                failing_since = None
            except HTTPException as error:
                now = time.monotonic()
                failing_since = failing_since or now
                if error.status_code != 503 or now - failing_since > TAKE_FAILURES_S:
                    self._fail_all(trainer, CallFailed(f"trainer {trainer}: {error.detail}", "server"))
                time.sleep(1.0)
                continue
            for outcome in outcomes:
                with self.lock:
                    future = self.waiting.get(trainer, {}).pop(outcome.key, None)
                if future is None:
                    continue
                if outcome.error is not None:
                    future.set_exception(CallFailed(outcome.error, outcome.category))
                else:
                    future.set_result(outcome.value)
            if not outcomes:
                time.sleep(POLL_IDLE_S)

    def _fail_all(self, trainer: str, error: Exception) -> None:
        with self.lock:
            waiting = self.waiting.pop(trainer, {})
        for future in waiting.values():
            future.set_exception(error)
