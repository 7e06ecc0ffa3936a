"""A trainer's interactive models (the Tinker API's training clients) and their calls, run in each model's
order and fused across models: `forward_backward` calls of different models that are ready together, or
arrive within `window_s` of the first, go through the base in one pass (actors/engine/interactive_step.py);
a lone call waits at most that window. Each model's calls run in the order of their `seq_id` (the SDK numbers
them; chunks of one call may arrive out of order), so an optimizer step applies exactly the gradients of the
calls before it. A call sent again with the same (model, seq_id) gets the first one's result.

`max_models_per_pass` (default None: no limit) caps how many models' calls share a pass, the models taking
turns; 1 with `window_s=0` serves the calls one model at a time, as time-sliced backends do (what
bench/tinker_clients.py compares fusing with).

A trainer loop that also steps jobs takes the leading forward_backward calls into a job step where they fit
(`take_for_step`, answered by `fused_ran`): they share that step's one pass through the base.

One thread steps (`run`); any thread submits. A call that fails (a bad datum, an unknown loss) fails alone:
its partners' step runs without it, and its model's order moves past it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from actors.engine.adapter_surgery import remove_adapter
from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallOutput, FusedCalls, ModelCall, base_limits, check_call
from actors.engine.models import BaseModel
from actors.engine.tinker_losses import LossInputError
from actors.engine.tinker_sampling import SampleCall
from actors.service.trainer.interactive_passes import (
    Pending,
    SamplingBatch,
    Taken,
    attach_saved_sampler,
    pass_record,
    run_other,
    run_pass,
)
from actors.storage.base_identity import tokenizer_folder, tokenizer_id

DEFAULT_WINDOW_S = 0.005
ACTIVE_FOR_S = 2.0   # a model that took part in a pass this recently is waited for (at most the window)


@dataclass
class SamplingQueue:
    """The sampling calls waiting to decode together, and the batch decoding now (one at a time). `slice_s`: how
    long one pass decodes a batch before the trainer's other work has its turn (None: a batch decodes whole)."""

    slice_s: float | None = None
    waiting: list[Pending] = field(default_factory=list)
    running: SamplingBatch | None = None

    def adapters(self) -> frozenset[str]:
        """The adapters the batch decoding now reads (not taken off or replaced until it ends)."""
        return self.running.run.adapters if self.running is not None else frozenset()


@dataclass
class ModelState:
    model: InteractiveModel
    owner: str | None
    next_seq: int = 1            # create_model is seq 0
    waiting: dict[int, Pending] = field(default_factory=dict)
    seen: dict[int, Future] = field(default_factory=dict)   # seq_id -> its future (a resend gets it)


class PassWindow:
    """When the calls that wait run (its owner's lock held for every call): once every model that took part in a
    pass in the last ACTIVE_FOR_S has its next call here, or once the first call now waiting has waited `window_s`
    for partners."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.ready_since: float | None = None   # when the first call now waiting arrived (monotonic)
        self.recent: dict[str, float] = {}      # model id -> when it last took part in a pass (monotonic)

    def arrived(self) -> None:
        if self.ready_since is None:
            self.ready_since = time.monotonic()

    def restart(self) -> None:
        """Calls that arrive from now on wait for partners afresh."""
        self.ready_since = None

    def took_part(self, model_ids: Iterable[str]) -> None:
        now = time.monotonic()
        self.recent.update((model_id, now) for model_id in model_ids)

    def forget(self, model_id: str) -> None:
        self.recent.pop(model_id, None)

    def partners(self) -> list[str]:
        """The models that took part in a pass in the last ACTIVE_FOR_S."""
        now = time.monotonic()
        return [model_id for model_id, when in self.recent.items() if now - when <= ACTIVE_FOR_S]

    def left(self) -> float:
        """How long the first call now waiting still waits for partners."""
        return max(0.0, (self.ready_since or 0.0) + self.window_s - time.monotonic())


class InteractiveCalls:
    """The interactive models on one base and their pending calls."""

    def __init__(self, base: BaseModel, *, window_s: float = DEFAULT_WINDOW_S, max_pass_tokens: int | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_ready: Callable[[], None] | None = None, max_models_per_pass: int | None = None,
                 sample_slice_s: float | None = None):
        if max_models_per_pass is not None and max_models_per_pass < 1:
            raise ValueError(f"max_models_per_pass must be at least 1 (or None: no limit), not {max_models_per_pass}")
        self.base = base
        self.window = PassWindow(window_s)
        self.max_pass_tokens = max_pass_tokens   # a pass's tokens at most (a trainer's step_tokens); None: any
        self.max_models_per_pass = max_models_per_pass
        self.turn = 0                    # where the next capped pass starts looking, in the models' order
        self.on_step = on_step           # told each fused pass: its models, datums and tokens
        self.on_ready = on_ready         # told when a call arrives (a trainer loop's wake-up)
        self.models: dict[str, ModelState] = {}
        self.sampling = SamplingQueue(sample_slice_s)   # sampling calls, batched together, decoded in slices
        # adapters to take off the base, or saved sampler weights to attach, in order, by the stepping thread:
        # (name, None, None) or (name, folder, a future done once attached)
        self.adapter_changes: list[tuple[str, str | None, Future | None]] = []
        self.lock = threading.Condition()
        self.closed = False

    # -- from any thread -------------------------------------------------------------------------------
    def create_model(self, model_id: str, rank: int, *, owner: str | None = None, seed: int = 0,
                     train_attn: bool = True, train_mlp: bool = True, first_seq: int = 1,
                     base_model: str | None = None, train_unembed: bool = False) -> None:
        """A new model; its calls start at `first_seq` (1 after a create_model, which is 0; 0 where the model
        is created by its first call, a load). `base_model`: the name the API gave the base (this one);
        `train_unembed`: LoRA on the LM head too (actors/engine/head_lora.py)."""
        with self.lock:
            if model_id in self.models:
                return   # the SDK's retry of the same create
            model = InteractiveModel(self.base, adapter_name(model_id), rank, seed=seed, train_attn=train_attn,
                                     train_mlp=train_mlp, train_unembed=train_unembed)
            self.models[model_id] = ModelState(model, owner, next_seq=first_seq)

    def submit(self, model_id: str, seq_id: int, kind: str, payload: Any) -> Future:
        """Queue a call of `model_id` at its place `seq_id` in the model's order; its future holds the result
        (a CallOutput, an optimizer step's metrics, or what an `apply` function returned)."""
        with self.lock:
            state = self._state(model_id)
            if seq_id in state.seen:
                return state.seen[seq_id]
            if seq_id < state.next_seq:
                raise ValueError(f"model {model_id}: seq_id {seq_id} was already run (the next is "
                                 f"{state.next_seq})")
            pending = Pending(kind, payload)
            state.waiting[seq_id] = pending
            state.seen[seq_id] = pending.future
            self._arrived()
            return pending.future

    def submit_sample(self, call: SampleCall, *, model_id: str | None = None, base_model: str | None = None,
                      trainer: str | None = None) -> Future:
        """Queue a sampling call (no order among them: all waiting ones decode in one batch). `model_id`,
        `base_model`, `trainer`: whose sampler it samples, which base, or which trainer holds it (this one)."""
        pending = Pending("sample", call)
        with self.lock:
            self.sampling.waiting.append(pending)
            self._arrived()
        return pending.future

    def finish(self, model_id: str, last: Callable[[InteractiveModel], Any] | None = None) -> Future:
        """End a model after the calls it has (its session ended): `last` (e.g. a save of its final adapter)
        runs after them, then the model is removed. The future holds what `last` returned."""
        with self.lock:
            state = self._state(model_id)
            seq = max([state.next_seq - 1, *state.waiting, *state.seen]) + 1
        done = self.submit(model_id, seq, "apply", last or (lambda model: None))
        done.add_done_callback(lambda _: self.remove_model(model_id))
        return done

    def remove_model(self, model_id: str) -> None:
        """Close a model: its waiting calls fail, its adapter leaves the base at the next step."""
        with self.lock:
            self.window.forget(model_id)
            state = self.models.pop(model_id, None)
            if state is None:
                return
            self.adapter_changes.append((state.model.name, None, None))
            self.lock.notify_all()
        for pending in state.waiting.values():
            pending.future.set_exception(KeyError(f"model {model_id} was closed"))

    def hold_sampler(self, name: str, folder: str, base_model: str | None = None) -> tuple[None, Future]:
        """Attach the sampler weights saved in `folder` as the frozen adapter `name` at the next step (a model's
        saved sampler that is no longer on the base: its model ended, or the server restarted). (None: this
        trainer; a future done once attached, or failed with why.) `base_model`: this base's name (unused here)."""
        done: Future = Future()
        with self.lock:
            self.adapter_changes.append((name, folder, done))
            self._arrived()
        return None, done

    def remove_adapter(self, name: str, model_id: str | None = None, trainer: str | None = None) -> None:
        """Take a snapshot adapter (a sampler's) off the base at the next step."""
        with self.lock:
            self.adapter_changes.append((name, None, None))
            self.lock.notify_all()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def _arrived(self) -> None:
        """A call arrived (the lock held): the stepping thread, or the trainer loop hosting these calls, hears."""
        self.window.arrived()
        self.lock.notify_all()
        if self.on_ready is not None:
            self.on_ready()

    def due(self) -> bool:
        """Whether a step should run now: a call is ready, and either every model that took part in a pass
        lately has its next call ready too, or the first call has waited `window_s` for partners (what a trainer
        loop that hosts these calls asks between its jobs' steps)."""
        return self.wait_left() == 0.0

    def wait_left(self) -> float | None:
        """How long until `due()` (None: nothing is waiting)."""
        with self.lock:
            if not self._ready():
                return None
            if self.sampling.running is not None or self._partners_ready():
                return 0.0
            return self.window.left()

    def _partners_ready(self) -> bool:
        """(The lock held.) Whether every model that took part in a pass in the last ACTIVE_FOR_S has its next
        call here: then nobody is worth waiting for (a lone user's calls run at once, and users whose loops go in
        step meet without waiting the window out). False before any pass: the first calls wait the window."""
        recent = self.window.partners()
        return bool(recent) and all(model_id in self.models and self.models[model_id].next_seq in
                                    self.models[model_id].waiting for model_id in recent)

    def rank_of(self, model_id: str) -> int | None:
        """The model's LoRA rank; None for a model not here."""
        with self.lock:
            state = self.models.get(model_id)
        return None if state is None else state.model.rank

    def facts(self) -> dict[str, Any]:
        """What the API says of the base: its context length, architecture, end-of-sequence token, and where its
        tokenizer loads from (`tokenizer_id`: the base's hub id or folder; None where it has neither, e.g. a
        GGUF file of its own; `tokenizer_folder`: the folder on the trainer's machine it is read from without the
        hub, or None)."""
        config = self.base.model.config
        tokenizer = self.base.tokenizer
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        return {"context": int(getattr(config, "max_position_embeddings", 0)) or None,
                "arch": getattr(config, "model_type", None), "eos": eos if isinstance(eos, int) else None,
                "tokenizer_id": tokenizer_id(self.base.name, self.base.source),
                "tokenizer_folder": tokenizer_folder(self.base.source)}

    def _state(self, model_id: str) -> ModelState:
        try:
            return self.models[model_id]
        except KeyError:
            raise KeyError(f"no model {model_id}") from None

    # -- the stepping thread ---------------------------------------------------------------------------
    def run(self) -> None:
        """Step until `close()`."""
        while True:
            with self.lock:
                while not self.closed and not self._ready():
                    self.lock.wait(timeout=1.0)
                if self.closed:
                    return
            with self.lock:   # partners that arrive meanwhile join the pass
                while not self.closed and (left := self.wait_left()):
                    self.lock.wait(timeout=left)
            self.step()

    def _ready(self) -> bool:
        return (bool(self.sampling.waiting) or self.sampling.running is not None or bool(self.adapter_changes)
                or any(state.next_seq in state.waiting for state in self.models.values()))

    def step(self) -> int:
        """Run what is ready: first every model's leading forward(_backward) calls, fused; then each model's
        next other call (an optimizer step, a save). Returns how many calls ran."""
        with self.lock:
            in_use = self.sampling.adapters()   # changed once the batch decoding through them has ended
            changes = [change for change in self.adapter_changes if change[0] not in in_use]
            self.adapter_changes = [change for change in self.adapter_changes if change[0] in in_use]
            self.window.restart()   # calls that arrive from now on wait for partners afresh
        for name, folder, done in changes:
            if folder is None:
                remove_adapter(self.base.model, name)
            else:
                attach_saved_sampler(self.base, name, folder, done)
        with self.lock:
            passes: dict[str, list[tuple[str, int, Pending]]] = {"forward_backward": [], "forward": []}
            for model_id, state in self._in_turn():
                seq = state.next_seq
                while seq in state.waiting and state.waiting[seq].kind in passes:
                    passes[state.waiting[seq].kind].append((model_id, seq, state.waiting.pop(seq)))
                    seq += 1
                state.next_seq = seq
        ran = 0
        for kind, calls in passes.items():
            if calls:
                self._run_pass(calls, backward=kind == "forward_backward")
                ran += len(calls)
        with self.lock:
            others = []
            for state in self.models.values():
                pending = state.waiting.get(state.next_seq)
                if pending is not None and pending.kind not in passes:
                    others.append((state, state.waiting.pop(state.next_seq)))
                    state.next_seq += 1
        for state, pending in others:
            run_other(state.model, pending)
            ran += 1
        return ran + self._sample()

    def _sample(self) -> int:
        """Start a batch of the waiting sampling calls where none decodes, and decode the batch on for a slice:
        how many calls were taken or decoded."""
        with self.lock:
            samples = self.sampling.waiting if self.sampling.running is None else []
            if samples:
                self.sampling.waiting = []
        if samples:
            self.sampling.running = SamplingBatch.start(self.base, samples)
        if self.sampling.running is None:
            return len(samples)
        if self.sampling.running.advance(self.sampling.slice_s):
            self.sampling.running = None
        return len(samples) or 1

    def sampling_bytes(self) -> int:
        """What the sampling batch decoding now holds between its slices, at its longest (its KV cache)."""
        running = self.sampling.running
        return running.run.held_bytes() if running is not None else 0

    def take_for_step(self, room: int) -> tuple[list[Taken], FusedCalls]:
        """The leading forward_backward calls of the models (in turn), checked, whose tokens fit `room` together:
        taken out of their models' order to share a fused step of jobs (answered by `fused_ran` or
        `fused_failed`). A call that fails its check fails alone; a model's calls stop at one that does not fit."""
        vocab, longest = base_limits(self.base)
        taken: list[Taken] = []
        configs, refused = [], []
        with self.lock:
            for model_id, state in self._in_turn():
                seq = state.next_seq
                while (pending := state.waiting.get(seq)) is not None and pending.kind == "forward_backward":
                    tokens = sum(len(datum.tokens) for datum in pending.payload.datums)
                    if tokens > room:
                        break
                    del state.waiting[seq]
                    seq += 1
                    try:
                        configs.append(check_call(pending.payload, vocab, longest))
                    except LossInputError as error:   # this call alone fails
                        refused.append((pending, error))
                        continue
                    taken.append((model_id, tokens, pending))
                    room -= tokens
                state.next_seq = seq
            if taken and not self._ready():
                self.window.restart()
        for pending, error in refused:
            pending.future.set_exception(error)
        return taken, FusedCalls([pending.payload for _, _, pending in taken], configs)

    def fused_ran(self, taken: list[Taken], outputs: list[CallOutput]) -> dict[str, int]:
        """Answer the calls a fused step of jobs ran (`take_for_step`); each model's tokens in it."""
        model_tokens: dict[str, int] = {}
        with self.lock:
            self.window.took_part(model_id for model_id, _, _ in taken)
            for model_id, tokens, _ in taken:
                model_tokens[model_id] = model_tokens.get(model_id, 0) + tokens
        for (_, _, pending), output in zip(taken, outputs, strict=True):
            pending.future.set_result(output)
        return model_tokens

    @staticmethod
    def fused_failed(taken: list[Taken], error: Exception) -> None:
        """The fused step that took these calls failed (e.g. out of memory): each call says so."""
        for _, _, pending in taken:
            pending.future.set_exception(RuntimeError(f"the fused step failed: {error!r}"))

    def _in_turn(self) -> list[tuple[str, ModelState]]:
        """The models whose leading forward(_backward) calls join this pass (the lock held): every model, or
        with `max_models_per_pass` that many of those with such a call ready, taking turns in the models' order."""
        models = list(self.models.items())
        if self.max_models_per_pass is None or not models:
            return models
        start = self.turn % len(models)
        chosen = []
        for index in [*range(start, len(models)), *range(start)]:
            state = models[index][1]
            pending = state.waiting.get(state.next_seq)
            if pending is not None and pending.kind in ("forward_backward", "forward"):
                chosen.append(models[index])
                self.turn = index + 1
                if len(chosen) == self.max_models_per_pass:
                    break
        return chosen

    def _run_pass(self, calls: list[Taken], *, backward: bool) -> None:
        started = time.perf_counter()
        ran = run_pass(self.base, calls, backward=backward, max_pass_tokens=self.max_pass_tokens)
        if ran is None:
            return
        good, outputs = ran
        with self.lock:
            self.window.took_part(model_id for model_id, _, _ in good)
        if self.on_step is not None:
            self.on_step(pass_record(good, backward, time.perf_counter() - started))
        for (_, _, pending), output in zip(good, outputs, strict=True):
            pending.future.set_result(output)


def adapter_name(model_id: str) -> str:
    """The adapter's name on the base for a model id (`<session>:train:<n>`): module-safe characters only."""
    return "tinker-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in model_id)


__all__ = ["AdamStep", "InteractiveCalls", "ModelCall", "adapter_name"]
