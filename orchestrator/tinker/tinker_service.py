"""The Tinker API's calls to a running aspen service over Ray (`Client.tinker`; in `aspen http`, run by the process
holding its Ray connection, orchestrator/http/bridge.py): open a model as a job (the scheduler enters it and
names the trainer that holds it), then talk to that trainer directly: each call is queued there and answered at
once with a key, and the outcomes are taken later by the front that sent them (actors/trainer_actor.py's
tinker_* methods). Errors come back as the HTTP answers the SDK expects: a permanent problem 4xx with its
reason (the SDK does not retry it), a trainer or service that cannot answer now 503 (it does).

A trainer actor answers one call at a time, between its passes, and a pass may run for minutes (a sampling of
thousands of tokens, a long step): a call to queue something there (submit, sample, take, ...) that it has not
answered within `QUEUE_WAIT_S` is not abandoned, since the trainer runs it once the pass ends (a `take` abandoned
so would take outcomes no one reads). Its reference is kept under the call's token and the same request waited on
again when the front asks again (orchestrator/tinker/patient_sends.py); the answer meanwhile is a 503 marked
`BUSY_HEADER`. Hundreds of calls may wait on one busy trainer (an RL loop's samples): none of them holds a thread of
the process holding the Ray connection while it waits. A call to a trainer known busy (a kept call there still
unanswered) is not waited for at all, a kept call asked for again is answered at once (its key, or busy again), and
the front waits for all its kept calls in one request (`ready`: one `ray.wait` over their references)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from fastapi import HTTPException

from actors.service.scheduler.config import NAMESPACE

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
QUEUE_WAIT_S = 10.0   # a call that queues work on a trainer, which answers at once between passes
KEPT_S = 600.0        # a busy call's reference that no one asks for (again, or in `ready`) this long is dropped
READY_WAIT_S = 10.0   # the longest `ready` waits for one of the kept calls to be answered


LOST_HEADER = "X-Aspen-Trainer-Lost"   # on a 503 whose trainer is gone (its actor died): its id
BUSY_HEADER = "X-Aspen-Trainer-Busy"   # on a 503 whose trainer is alive and in a long pass: its id


def _get(ref: Any, what: str, trainer: str | None = None, timeout: float = CALL_TIMEOUT_S) -> Any:
    """The call's result; its errors as HTTP answers (a KeyError 404, a ValueError or TypeError 422, the
    service's refusal for want of room, a trainer that is gone, a timeout: 503, which the SDK retries; a user at
    their max_running: 429, which it retries too; a trainer's timeout marked busy)."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        if trainer is not None:
            waited = f"it has not answered within {timeout:.0f}s: " if timeout >= 1 else ""
            raise HTTPException(503, f"{what}: trainer {trainer} is busy ({waited}a long sampling or step runs "
                                     "there); the call is kept and runs once that pass ends",
                                headers={"Retry-After": "5", BUSY_HEADER: trainer}) from None
        raise HTTPException(503, f"{what}: the service did not answer within {timeout:.0f}s",
                            headers={"Retry-After": "5"}) from None
    except RayActorError as error:
        headers = {"Retry-After": "5"} | ({LOST_HEADER: trainer} if trainer is not None else {})
        raise HTTPException(503, f"{what}: its trainer or the scheduler is gone ({type(error).__name__}); try "
                                 "again", headers=headers) from None
    except RayTaskError as error:
        cause = error.cause if getattr(error, "cause", None) is not None else error
        message = str(cause.args[0]) if getattr(cause, "args", None) else str(cause)
        if type(cause).__name__ == "OverQuota":   # the user's max_running: a quota, as the HTTP API answers one
            raise HTTPException(429, message, headers={"Retry-After": "30"}) from None
        if type(cause).__name__ == "NoRoom":
            raise HTTPException(503, message, headers={"Retry-After": "30"}) from None
        if isinstance(cause, KeyError):
            raise HTTPException(404, message) from None
        if isinstance(cause, (ValueError, TypeError)):
            raise HTTPException(422, message) from None
        raise


class TinkerService:
    """The service's side of the Tinker API, for one Ray driver: trainer handles by trainer id."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.handles: dict[str, Any] = {}
        # a busy trainer's call by its token: (its ref, when kept, the trainer)
        self.kept: dict[str, tuple[Any, float, str]] = {}
        self.kept_lock = threading.Lock()
        self.bases_of: dict[str, dict[str, Any]] = {}   # a trainer's base facts (`facts`)

    def _trainer(self, trainer: str) -> Any:
        handle = self.handles.get(trainer)
        if handle is None:
            described = {t["id"]: t for t in _get(self.scheduler.trainers.remote(), "the trainers")}
            if trainer not in described or not described[trainer].get("actor_name"):
                raise HTTPException(404, f"trainer {trainer} is not in the service any more; its models ended")
            handle = ray.get_actor(described[trainer]["actor_name"], namespace=NAMESPACE)
            self.handles[trainer] = handle
        return handle

    def bases(self) -> list[str]:
        """The base models of the ready single-device trainers (what the API serves)."""
        trainers = _get(self.scheduler.trainers.remote(), "the trainers")
        return sorted({t["base_model"] for t in trainers if t.get("ready") and t.get("stages", 1) == 1
                       and not t.get("retired")})

    def open(self, model_id: str, base_model: str, rank: int, user: str | None, seed: int = 0,
             train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1,
             train_unembed: bool = False) -> dict[str, Any]:
        """Enter the model as a job and create it on its trainer: {job, trainer, output_dir}."""
        answer = _get(self.scheduler.open_interactive.remote(model_id, base_model, rank, user, train_attn, train_mlp,
                                                             train_unembed), f"create model {model_id}")
        handle = answer.pop("handle")
        if handle is not None:
            self.handles[answer["trainer"]] = handle
        trainer, job = answer["trainer"], answer["job"]
        try:
            ref = self._trainer(trainer).tinker_open.remote(job, model_id, rank, user, seed, train_attn, train_mlp,
                                                            first_seq, answer["output_dir"], base_model, False,
                                                            train_unembed)
            _get(ref, f"create model {model_id}", trainer, 0.0 if self._known_busy(trainer) else QUEUE_WAIT_S)
        except HTTPException as error:
            if BUSY_HEADER not in (error.headers or {}):
                if LOST_HEADER in (error.headers or {}):
                    self.handles.pop(trainer, None)
                self.scheduler.close_interactive.remote(job, "failed", f"its trainer could not create it: "
                                                                       f"{error.detail}")
                raise
            # the trainer is in a long pass: the model is created there once it ends, before any later call of
            # this process to that trainer (an actor runs one caller's calls in order); a refusal then ends its job
            ref.future().add_done_callback(lambda done: self._opened_late(done, job, model_id, trainer))
        except Exception:
            self.scheduler.close_interactive.remote(job, "failed", "its trainer could not create it")
            raise
        return answer

    def _opened_late(self, done: Any, job: str, model_id: str, trainer: str) -> None:
        """A model's creation queued behind a long pass has run: its job failed where the trainer refused it."""
        error = done.exception()
        if error is not None:
            cause = getattr(error, "cause", None) or error
            log.warning("tinker: trainer %s could not create model %s after its pass: %s", trainer, model_id, cause)
            self.scheduler.close_interactive.remote(job, "failed", f"its trainer could not create it: {cause}")

    def reopen(self, job_id: str, model_id: str, lost_trainer: str, base_model: str, rank: int, user: str | None,
               seed: int = 0, train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1,
               train_unembed: bool = False) -> dict[str, Any]:
        """Place a model whose trainer was lost again and create it there from its checkpoint: {job, trainer,
        output_dir, checkpoint_seq (None: none; its calls from `first_seq` on are to be sent again)}."""
        self.handles.pop(lost_trainer, None)
        answer = _get(self.scheduler.reopen_interactive.remote(job_id, lost_trainer), f"resume model {model_id}")
        handle = answer.pop("handle")
        if handle is not None:
            self.handles[answer["trainer"]] = handle
        answer["checkpoint_seq"] = self._on(answer["trainer"], "tinker_open", f"resume model {model_id}", job_id,
                                            model_id, rank, user, seed, train_attn, train_mlp, first_seq,
                                            answer["output_dir"], base_model, True, train_unembed)
        return answer

    def _on(self, trainer: str, method: str, what: str, *args: Any) -> Any:
        """A trainer actor's method; a trainer found dead is forgotten (its successor is looked up next time)."""
        try:
            return _get(getattr(self._trainer(trainer), method).remote(*args), what, trainer)
        except HTTPException as error:
            if LOST_HEADER in (error.headers or {}):
                self.handles.pop(trainer, None)
            raise

    def _queue_on(self, trainer: str, token: str | None, method: str, what: str, *args: Any,
                  wait_again: float = 0.0) -> Any:
        """A trainer actor's method that queues work there (answered at once between passes), waited for up to
        `QUEUE_WAIT_S` (not at all on a trainer known busy): unanswered, its reference is kept under `token` (and
        this request answered busy), and the same token's next request takes its answer instead of sending the call
        twice, waiting up to `wait_again` for it (none: the front waits for its kept calls in `ready`)."""
        now = time.monotonic()
        with self.kept_lock:
            for stale in [key for key, (_, when, _) in self.kept.items() if now - when > KEPT_S]:
                del self.kept[stale]
            ref = self.kept.pop(token, (None,))[0] if token is not None else None
        wait = wait_again
        if ref is None:
            wait = 0.0 if token is not None and self._known_busy(trainer) else QUEUE_WAIT_S
            ref = getattr(self._trainer(trainer), method).remote(*args)
        try:
            return _get(ref, what, trainer, wait)
        except HTTPException as error:
            headers = error.headers or {}
            if LOST_HEADER in headers:
                self.handles.pop(trainer, None)
            elif BUSY_HEADER in headers and token is not None:
                with self.kept_lock:
                    self.kept[token] = (ref, now, trainer)
            raise

    def _known_busy(self, trainer: str) -> bool:
        """Whether a call kept for `trainer` is still unanswered: the trainer is in a pass, and a call sent now is
        answered only after it (an actor runs one caller's calls in order)."""
        with self.kept_lock:
            refs = [ref for ref, _, on in self.kept.values() if on == trainer]
        return bool(refs) and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs)

    def ready(self, tokens: list[str], timeout: float = READY_WAIT_S) -> list[str]:
        """Those of `tokens` whose kept call has its answer (or is kept no longer: asked for again, it is sent anew),
        after waiting up to `timeout` (at most `READY_WAIT_S`) for the first: one wait for all of a front's calls
        on busy trainers."""
        now = time.monotonic()
        with self.kept_lock:
            refs = {token: self.kept[token][0] for token in tokens if token in self.kept}
            for token in refs:   # asked for: its front waits for it (a pass may outlast KEPT_S), so it is kept on
                ref, _, trainer = self.kept[token]
                self.kept[token] = (ref, now, trainer)
        gone = [token for token in tokens if token not in refs]
        if not refs:
            return gone
        waiting = list(refs.values())
        if not gone:
            ray.wait(waiting, num_returns=1, timeout=max(0.0, min(timeout, READY_WAIT_S)))
        answered = set(ray.wait(waiting, num_returns=len(waiting), timeout=0)[0])
        return gone + [token for token, ref in refs.items() if ref in answered]

    def trainer_of_base(self, base_model: str) -> str:
        answer = _get(self.scheduler.interactive_trainer.remote(base_model), f"a trainer of {base_model}")
        if answer.get("handle") is not None:
            self.handles[answer["trainer"]] = answer["handle"]
        return answer["trainer"]

    # `token`: the front's name for the call, the same when it asks again after a busy answer (`_queue_on`)
    def submit(self, trainer: str, front: str, model_id: str, seq_id: int, kind: str, payload: Any,
               token: str | None = None) -> str:
        return self._queue_on(trainer, token, "tinker_submit", f"model {model_id}'s call {seq_id}", front, model_id,
                              seq_id, kind, payload)

    def sample(self, trainer: str, front: str, call: Any, token: str | None = None) -> str:
        return self._queue_on(trainer, token, "tinker_sample", "a sampling call", front, call)

    def take(self, trainer: str, front: str) -> list[Any]:
        """The outcomes waiting for `front`; a take left unanswered by a busy trainer is waited on again (it would
        take outcomes that no one reads)."""
        return self._queue_on(trainer, f"take:{trainer}:{front}", "tinker_take", f"the outcomes on {trainer}", front,
                              wait_again=QUEUE_WAIT_S)

    def finish(self, trainer: str, front: str, model_id: str, last: Any, token: str | None = None) -> str:
        return self._queue_on(trainer, token, "tinker_finish", f"ending model {model_id}", front, model_id, last)

    def close_job(self, job_id: str, state: str, reason: str, adapter_dir: str | None = None) -> None:
        _get(self.scheduler.close_interactive.remote(job_id, state, reason, adapter_dir), f"ending job {job_id}")

    def beat(self, trainer: str, model_ids: list[str]) -> list[str]:
        """The models of `model_ids` that `trainer` ended; on a trainer known busy the heartbeat is queued there
        (it counts once the pass ends) and not waited for."""
        if self._known_busy(trainer):
            self._trainer(trainer).tinker_beat.remote(model_ids)
            return []
        return self._on(trainer, "tinker_beat", "a heartbeat", model_ids)

    def drop_adapter(self, trainer: str, name: str) -> None:
        self._on(trainer, "tinker_drop_adapter", "dropping a sampler", name)

    def cancel(self, trainer: str, key: str) -> bool:
        return self._on(trainer, "tinker_cancel", "cancelling a sampling call", key)

    def hold_sampler(self, trainer: str, front: str, name: str, folder: str, token: str | None = None) -> str:
        return self._queue_on(trainer, token, "tinker_hold_sampler", f"reading the sampler weights in {folder}", front,
                              name, folder)

    def facts(self, trainer: str) -> dict[str, Any]:
        """What the SDK is told of `trainer`'s base (its context, tokenizer): known once, since a trainer (and one
        that takes its place) holds one base, so that a client created while it is in a long pass need not wait.
        Read from the trainer's status as the scheduler has it (the scheduler answers during the trainer's passes);
        asked of the trainer itself only where that status has none yet."""
        if trainer not in self.bases_of:
            described = {t["id"]: t for t in _get(self.scheduler.trainers.remote(), "the trainers")}
            facts = described.get(trainer, {}).get("base_facts")
            self.bases_of[trainer] = facts or self._on(trainer, "tinker_facts", f"the base of {trainer}")
        return self.bases_of[trainer]
