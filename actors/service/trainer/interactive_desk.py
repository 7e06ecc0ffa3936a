"""A trainer's desk for the interactive models it holds as service jobs (the Tinker API's, reached through the
HTTP server's Ray connection): it opens a model for its job, takes each call without waiting for it (a key
comes back), and keeps each finished call's outcome for the front that sent it until that front takes it
(`take`), so that a trainer actor that answers one call at a time never blocks on a model's call.

Each model is checkpointed (its adapter and AdamW state, `checkpoint/` in its job's folder) every
`checkpoint_every` optimizer steps, right after the step and before its next call, with the `seq_id` of that
step: a front whose trainer is lost opens the model again on another from that checkpoint and sends the calls
after it again (orchestrator/tinker/remote_calls.py), so that nothing its user was answered is lost.

A model whose front stops beating for it (`beat`, each heartbeat of its session; the HTTP server that held the
session gone) is ended here after `heartbeat_timeout_s`, as its session's end would: its last calls run, its
final adapter is written to its job's folder, and its job completes (a `completed` event).

It also reports each model as a job: every fused pass is a row of the trainer's step log and a `step` event
(each job accounted its tokens, as a batch job's share of a fused step is: fair share and the accounts), and
every optimizer step a `progress` event (its step, the summed loss of the calls since the last, its tokens),
which the scheduler books in the job table like any job's."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.checkpoint.interactive_state import read_checkpoint, write_checkpoint
from actors.service.trainer.interactive_calls import InteractiveCalls
from actors.service.trainer.interactive_commands import SaveSampler
from actors.service.trainer.trainer_reports import TrainerEvents

# how a failed call's error reads to its user: their own mistake ("user": the SDK does not retry) or not
log = logging.getLogger(__name__)

USER_ERRORS = (ValueError, KeyError, TypeError)
# a front (an HTTP server) that has not taken its outcomes this long is gone (killed, restarted under a new name): they
# are dropped. Longer than a front waits on a trainer busy in one pass (patient_sends.BUSY_LIMIT_S, 30 minutes), after
# which it has failed those calls itself, so no live front's outcomes are dropped.
FRONT_GONE_S = 3600.0


@dataclass(frozen=True)
class Outcome:
    """A call's end as its front reads it: its value, or its error's category and message."""

    key: str
    value: Any = None
    error: str | None = None
    category: str = "server"
    checkpoint_seq: int | None = None   # the model was checkpointed after this call (its seq_id)


@dataclass
class ModelJob:
    """A model and the job it is: what its next progress event reports."""

    job_id: str
    owner: str | None
    output_dir: str | None = None   # its job's folder: checkpoints go to `checkpoint/` there
    base_name: str = ""
    beat: float = field(default_factory=time.monotonic)   # its front's last heartbeat for it
    step: int = 0
    tokens: int = 0          # since the last optimizer step
    loss_sum: float = 0.0    # of the forward_backward calls since the last optimizer step
    calls: int = 0


class CallKeys:
    """The keys of a trainer's calls, its sampling calls' futures by key while they wait (a front may cancel one its
    client abandoned), and why it refused to create a model (its calls may have been queued behind that)."""

    def __init__(self, trainer_id: str):
        self.trainer_id = trainer_id
        self.count = itertools.count(1)
        self.samples: dict[str, Future] = {}
        # a model's call by (model, seq_id) -> its key: the same call sent twice (a front's request it stopped
        # waiting for, then sent again) is the same call, counted once, its outcome under one key
        self.calls: dict[tuple[str, int], str] = {}
        self.taken_at: dict[str, float] = {}   # a front -> when it last took its outcomes (or its first waited)
        # a model whose creation this trainer refused -> why: its calls, queued behind that creation, say so
        self.refused: dict[str, str] = {}

    def next(self) -> str:
        return f"{self.trainer_id}:{next(self.count)}"


class InteractiveDesk:
    """The interactive models of one trainer as jobs, and their calls' outcomes by front."""

    def __init__(self, calls: InteractiveCalls, events: TrainerEvents, trainer_id: str,
                 write_step: Callable[[dict[str, Any]], None], gpus: int = 0, checkpoint_every: int = 10,
                 heartbeat_timeout_s: float = 300.0):
        self.calls = calls
        self.checkpoint_every = checkpoint_every
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.events = events
        self.trainer_id = trainer_id
        self.write_step = write_step
        self.gpus = gpus
        self.models: dict[str, ModelJob] = {}
        self.outcomes: dict[str, list[Outcome]] = {}   # front -> outcomes not yet taken
        self.keys = CallKeys(trainer_id)
        self.lock = threading.Lock()
        self.passes = 0
        calls.on_step = self._pass_ran

    # -- the front's calls (the trainer actor's tinker_* methods) -------------------------------------------
    def open(self, job_id: str, model_id: str, rank: int, *, owner: str | None, seed: int = 0,
             train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1, output_dir: str | None = None,
             base_name: str = "", resume: bool = False, train_unembed: bool = False) -> int | None:
        """Create the model for its job. `resume`: from its checkpoint in `output_dir` (its calls then start after
        the checkpoint's); returns that checkpoint's seq_id (None: none, the model starts afresh at `first_seq`)."""
        saved = read_checkpoint(Path(output_dir)) if resume and output_dir else None
        if saved is not None:
            first_seq = int(saved[0]["seq"]) + 1
        try:
            self.calls.create_model(model_id, rank, owner=owner, seed=seed, train_attn=train_attn,
                                    train_mlp=train_mlp, first_seq=first_seq, train_unembed=train_unembed)
        except (ValueError, TypeError) as error:
            with self.lock:
                self.keys.refused[model_id] = str(error)
            raise
        model = ModelJob(job_id, owner, output_dir, base_name)
        if saved is not None:
            facts, weights, optimizer = saved
            self.calls.models[model_id].model.load(weights, optimizer)
            self.calls.models[model_id].model.steps = model.step = int(facts.get("steps", 0))
        with self.lock:
            self.models.setdefault(model_id, model)
        return None if saved is None else int(saved[0]["seq"])

    def submit(self, front: str, model_id: str, seq_id: int, kind: str, payload: Any) -> str:
        """Queue a call; its outcome waits for `front` under the key returned."""
        if not callable(payload) and kind == "apply":
            raise TypeError(f"an apply call's payload must be callable, not {type(payload).__name__}")
        lr = getattr(payload, "learning_rate", None) if kind == "optim_step" else None   # the step's, for progress
        try:
            future = self.calls.submit(model_id, seq_id, kind, payload)
        except KeyError:
            with self.lock:
                refused = self.keys.refused.get(model_id)
            if refused is None:
                raise
            raise KeyError(f"model {model_id} was never created on trainer {self.trainer_id}: {refused}") from None
        with self.lock:
            known = self.keys.calls.get((model_id, seq_id))
        if known is not None:
            return known
        key = self._track(front, future, model_id, kind, seq_id, lr)
        with self.lock:
            self.keys.calls[(model_id, seq_id)] = key
        return key

    def sample(self, front: str, call: Any) -> str:
        return self._track(front, self.calls.submit_sample(call), None, "sample")

    def cancel(self, key: str) -> bool:
        """Cancel the sampling call of `key` where it has not started (its outcome then says so); whether it was."""
        with self.lock:
            future = self.keys.samples.get(key)
        return future is not None and future.cancel()

    def hold_sampler(self, front: str, name: str, folder: str) -> str:
        """Attach saved sampler weights as the frozen adapter `name` (a front's sampling session on a model that
        ended); the outcome (the name, or why not) waits for `front` under the key returned."""
        return self._track(front, self.calls.hold_sampler(name, folder)[1], None, "hold")

    def take(self, front: str) -> list[Outcome]:
        """The outcomes finished for `front` since it last took them."""
        with self.lock:
            self.keys.taken_at[front] = time.monotonic()
            return self.outcomes.pop(front, [])

    def finish(self, front: str, model_id: str, last: Callable[[Any], Any] | None) -> str:
        """End a model after its calls (its session ended): `last` (its final save) runs after them, then it
        leaves the base; the outcome (what `last` returned) waits for `front` under the key returned."""
        key = self._track(front, self.calls.finish(model_id, last), None, "finish")
        with self.lock:
            self.models.pop(model_id, None)
            self._forget_calls(model_id)
        return key

    def beat(self, model_ids: list[str]) -> list[str]:
        """Its front's heartbeat for these models; the ones not here (ended, or lost with a trainer)."""
        now = time.monotonic()
        missing = []
        with self.lock:
            for model_id in model_ids:
                if model_id in self.models:
                    self.models[model_id].beat = now
                else:
                    missing.append(model_id)
        return missing

    def reap(self, now: float | None = None) -> list[str]:
        """End the models whose front has not beaten for `heartbeat_timeout_s` (its HTTP server gone): each after
        its last calls, its final adapter in its folder, its job completed. Returns their ids."""
        now = time.monotonic() if now is None else now
        self._drop_unclaimed(now)
        with self.lock:
            silent = [(model_id, model) for model_id, model in self.models.items()
                      if now - model.beat > self.heartbeat_timeout_s]
            for model_id, _ in silent:
                del self.models[model_id]
                self._forget_calls(model_id)
        for model_id, model in silent:
            reason = f"its session's server stopped beating for {self.heartbeat_timeout_s:.0f}s"
            last = None
            if model.output_dir:
                last = SaveSampler(Path(model.output_dir), model.base_name, model_id, model.owner or "",
                                   model.output_dir, None)
            done = self.calls.finish(model_id, last)
            done.add_done_callback(lambda future, model=model, reason=reason: self._ended(model, reason, future))
        return [model_id for model_id, _ in silent]

    def _drop_unclaimed(self, now: float) -> None:
        """Drop the outcomes of the fronts that have not taken theirs for FRONT_GONE_S (a killed HTTP server's: they
        stayed in the trainer's memory for good, a sample's whole result each)."""
        with self.lock:
            gone = [front for front in self.outcomes if now - self.keys.taken_at.setdefault(front, now) > FRONT_GONE_S]
            dropped = {front: len(self.outcomes.pop(front)) for front in gone}
            for front in gone:
                del self.keys.taken_at[front]
        for front, count in dropped.items():
            log.warning("trainer %s: dropped %d outcomes of %s, which has not taken them for %.0f s (its HTTP server "
                        "is gone)", self.trainer_id, count, front, FRONT_GONE_S)

    def _ended(self, model: ModelJob, reason: str, future: Future) -> None:
        error = future.exception()
        if error is None:
            self.events.emit("completed", model.job_id, model.step, reason=reason, adapter_dir=model.output_dir)
        else:
            self.events.emit("failed", model.job_id, model.step, reason=f"{reason}; its final save failed: {error}")

    def close(self, model_id: str) -> str | None:
        """Close a model (its waiting calls fail, its adapter leaves the base); its job id, None if unknown."""
        self.calls.remove_model(model_id)
        with self.lock:
            model = self.models.pop(model_id, None)
            self._forget_calls(model_id)
        return None if model is None else model.job_id

    def close_job(self, job_id: str) -> list[str]:
        """Close every model of a job (the scheduler cancelled it); their ids."""
        with self.lock:
            ids = [model_id for model_id, model in self.models.items() if model.job_id == job_id]
        for model_id in ids:
            self.close(model_id)
        return ids

    def drop_adapter(self, name: str) -> None:
        self.calls.remove_adapter(name)

    def facts(self) -> dict[str, Any]:
        return self.calls.facts()

    def job_ids(self) -> list[str]:
        with self.lock:
            return sorted({model.job_id for model in self.models.values()})

    def _forget_calls(self, model_id: str) -> None:
        """A model gone: its calls' keys (under the lock)."""
        for call in [call for call in self.keys.calls if call[0] == model_id]:
            del self.keys.calls[call]

    # -- outcomes, on the stepping thread -------------------------------------------------------------------
    def _track(self, front: str, future: Future, model_id: str | None, kind: str, seq: int | None = None,
               lr: float | None = None) -> str:
        key = self.keys.next()
        if kind == "sample":
            with self.lock:
                self.keys.samples[key] = future
        future.add_done_callback(lambda done: self._finished(front, key, done, model_id, kind, seq, lr))
        return key

    def _finished(self, front: str, key: str, future: Future, model_id: str | None, kind: str,
                  seq: int | None, lr: float | None = None) -> None:
        """A call ended (on the stepping thread, before the model's next call runs): its outcome for the front;
        an optimizer step is the job's progress, and every `checkpoint_every` steps its checkpoint."""
        if kind == "sample":
            with self.lock:
                self.keys.samples.pop(key, None)
        error = None if future.cancelled() else future.exception()
        if future.cancelled():
            outcome = Outcome(key, error="cancelled by its client before it ran", category="user")
        elif error is not None:
            category = "user" if isinstance(error, USER_ERRORS) else "server"
            outcome = Outcome(key, error=str(error) or type(error).__name__, category=category)
        else:
            checkpoint = None
            if model_id is not None:
                checkpoint = self._account(model_id, kind, future.result(), seq, lr)
            outcome = Outcome(key, value=future.result(), checkpoint_seq=checkpoint)
        with self.lock:
            self.outcomes.setdefault(front, []).append(outcome)

    def _account(self, model_id: str, kind: str, value: Any, seq: int | None, lr: float | None = None) -> int | None:
        """Book a call's end (an optimizer step's learning rate `lr`); the seq_id of the checkpoint written after
        it, if one was."""
        with self.lock:
            model = self.models.get(model_id)
        if model is None:
            return None
        if kind == "forward_backward":
            model.loss_sum += float(getattr(value, "loss_sum", 0.0))
            model.calls += 1
        elif kind == "optim_step":
            model.step += 1
            loss = model.loss_sum if model.calls else None
            self.events.emit("progress", model.job_id, model.step, step=model.step, loss=loss, tokens=model.tokens,
                             lr=lr, grad_norm=(value or {}).get("grad_norm:mean"), tokens_per_s=None)
            model.tokens, model.loss_sum, model.calls = 0, 0.0, 0
            if (seq is not None and model.output_dir and self.checkpoint_every
                    and model.step % self.checkpoint_every == 0 and model_id in self.calls.models):
                write_checkpoint(self.calls.models[model_id].model, Path(model.output_dir), model.base_name, model_id,
                                 model.owner or "", seq)
                self.events.emit("checkpoint", model.job_id, model.step)
                return seq
        return None

    def job_tokens(self, model_tokens: dict[str, int], *, backward: bool) -> dict[str, int]:
        """The models' tokens of a pass or a fused step as their jobs' (what each is accounted); a backward's
        count toward each model's trained tokens."""
        job_tokens: dict[str, int] = {}
        with self.lock:
            for model_id, tokens in model_tokens.items():
                model = self.models.get(model_id)
                if model is None:
                    continue
                if backward:
                    model.tokens += tokens
                job_tokens[model.job_id] = job_tokens.get(model.job_id, 0) + tokens
        return job_tokens

    def _pass_ran(self, summary: dict[str, Any]) -> None:
        """A fused pass of interactive calls: a row of the step log and a `step` event, each job its tokens."""
        self.passes += 1
        job_tokens = self.job_tokens(summary.get("model_tokens", {}), backward=bool(summary.get("backward")))
        if not job_tokens:
            return
        row = {"trainer": self.trainer_id, "time": round(time.time(), 3), "kind": "interactive",
               "interactive_pass": self.passes, "backward": bool(summary.get("backward")),
               "jobs": sorted(job_tokens), "job_tokens": job_tokens, "tokens": sum(job_tokens.values()),
               "padding_tokens": 0, "seconds": float(summary.get("seconds", 0.0)), "peak_memory_bytes": 0,
               "datums": summary.get("datums", 0), "gpus": self.gpus}
        self.write_step(row)
        self.events.emit("step", "", 0, **row)

