"""Running a trainer's interactive calls (the Tinker API's): a forward(_backward) pass over several models' calls
through the base, a batch of sampling calls, an optimizer step or another call on one model. A call that fails
its check fails alone, its partners run without it; a pass or a batch that fails (e.g. out of memory) answers
each of its calls with why; saved sampler weights attached for sampling. The order the calls run in is
`interactive_calls.InteractiveCalls`'s."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from actors.checkpoint.interactive_state import hold_sampler_weights
from actors.engine.adapter_surgery import non_finite_values, remove_adapter
from actors.engine.interactive_model import InteractiveModel
from actors.engine.interactive_step import CallOutput, base_limits, check_call, join_outputs, run_checked, split_passes
from actors.engine.models import BaseModel
from actors.engine.tinker_losses import LossInputError
from actors.engine.tinker_sampling import SampleCall, SampleRun, check_sample

log = logging.getLogger(__name__)


@dataclass
class Pending:
    kind: str                    # "forward_backward", "forward", "optim_step", "apply"
    payload: Any
    future: Future = field(default_factory=Future)


Taken = tuple[str, int, Pending]   # a call taken to run: its model, a number (its seq_id in a pass, its tokens in
#                                    a fused step of jobs), the call


def run_pass(base: BaseModel, calls: list[Taken], *, backward: bool,
             max_pass_tokens: int | None) -> tuple[list[Taken], list[CallOutput]] | None:
    """Run the calls' forward (and backward) through the base, in passes of at most `max_pass_tokens` (the
    trainer's step, its memory), most often one: (the calls that ran, their outputs), to be answered by the
    caller; None where none ran (each call already answered with why)."""
    vocab, longest = base_limits(base)
    good, configs = [], []
    for entry in calls:
        try:
            configs.append(check_call(entry[2].payload, vocab, longest))
            good.append(entry)
        except LossInputError as error:   # this call alone fails
            entry[2].future.set_exception(error)
    if not good:
        return None
    parts: list[list[CallOutput]] = [[] for _ in good]
    try:
        for group in split_passes([pending.payload for _, _, pending in good], max_pass_tokens):
            outputs = run_checked(base, [part for _, part in group], [configs[i] for i, _ in group],
                                  backward=backward)
            for (index, _), output in zip(group, outputs, strict=True):
                parts[index].append(output)
    except Exception as error:   # the pass failed (e.g. out of memory): each call says so
        log.exception("interactive pass of %d calls failed", len(good))
        for _, _, pending in good:
            pending.future.set_exception(RuntimeError(f"the fused pass failed: {error!r}"))
        return None
    return good, [join_outputs(part) for part in parts]


def pass_record(ran: list[Taken], backward: bool, seconds: float) -> dict[str, Any]:
    """The step log's row of a pass: its models, each model's tokens, datums and tokens in all."""
    model_tokens: dict[str, int] = {}
    for model_id, _, pending in ran:
        model_tokens[model_id] = model_tokens.get(model_id, 0) + sum(len(d.tokens) for d in pending.payload.datums)
    return {"time": time.time(), "backward": backward, "seconds": seconds,
            "models": sorted(model_tokens), "model_tokens": model_tokens,
            "datums": sum(len(p.payload.datums) for _, _, p in ran),
            "tokens": sum(len(d.tokens) for _, _, p in ran for d in p.payload.datums)}


class SamplingBatch:
    """The sampling calls decoding together (`SampleRun`), in slices between a trainer's other passes: `advance`
    decodes on and answers every call once all have ended (or each with why the batch failed)."""

    def __init__(self, run: SampleRun, calls: list[Pending]):
        self.run, self.calls = run, calls

    @classmethod
    def start(cls, base: BaseModel, samples: list[Pending]) -> SamplingBatch | None:
        """The calls' batch (each checked: one that fails its check, or was cancelled, is answered alone); None
        where none is left."""
        tokenizer = base.tokenizer
        decode_text = None if tokenizer is None else tokenizer.decode
        vocab = int(base.lm_head.weight.shape[0])
        context = int(getattr(base.model.config, "max_position_embeddings", 0)) or None
        good = []
        for pending in samples:
            if not pending.future.set_running_or_notify_cancel():   # its client abandoned it (cancel_future)
                continue
            try:
                check_sample_call(pending.payload, vocab, decode_text is not None, context)
                check_adapter_finite(base, pending.payload.adapter)
                good.append(pending)
            except ValueError as error:   # this call alone fails
                pending.future.set_exception(error)
        if not good:
            return None
        try:
            return cls(SampleRun(base, [pending.payload for pending in good], decode_text), good)
        except Exception as error:   # e.g. an adapter taken off meanwhile: each call says so
            log.exception("sampling batch of %d calls could not start", len(good))
            for pending in good:
                pending.future.set_exception(RuntimeError(f"sampling failed: {error!r}"))
            return None

    def advance(self, seconds: float | None = None) -> bool:
        """Decode on (to the end, or for `seconds` after one token); once every sample has ended, each call is
        answered. Whether the batch is over (ended, or failed: e.g. out of memory, each call told why)."""
        try:
            if not self.run.advance(seconds):
                return False
            results = self.run.results()
        except Exception as error:   # the batch failed: each call says so
            log.exception("sampling batch of %d calls failed", len(self.calls))
            for pending in self.calls:
                pending.future.set_exception(RuntimeError(f"sampling failed: {error!r}"))
            return True
        for pending, result in zip(self.calls, results, strict=True):
            pending.future.set_result(result)
        return True


def run_samples(base: BaseModel, samples: list[Pending]) -> None:
    """Sample every call's completions in one batch, to the end (each through its own adapter or the base), and
    answer them."""
    batch = SamplingBatch.start(base, samples)
    if batch is not None:
        batch.advance()


def attach_saved_sampler(base: BaseModel, name: str, folder: str, done: Future) -> None:
    """Saved sampler weights attached to the base as the frozen adapter `name` (hold_sampler_weights; a copy
    of that name already there is replaced: the same files again); `done` answered with the name, or with why
    they could not be (nothing of them stays then)."""
    remove_adapter(base.model, name)
    try:
        hold_sampler_weights(base, name, folder)
    except Exception as error:  # noqa: BLE001 - answered to the call that asked for it, which fails alone
        done.set_exception(error)
        return
    done.set_result(name)


def run_other(model: InteractiveModel, pending: Pending) -> None:
    """An optimizer step, or a function of the model (`apply`: save, load, ...), answered with its result."""
    try:
        if pending.kind == "optim_step":
            result = model.optim_step(pending.payload)
        elif pending.kind == "apply":
            result = pending.payload(model)
        else:
            raise ValueError(f"unknown call kind '{pending.kind}'")
    except Exception as error:  # noqa: BLE001 - this call fails alone, with its reason
        pending.future.set_exception(error)
        return
    pending.future.set_result(result)


def check_sample_call(call: SampleCall, vocab_size: int, has_tokenizer: bool, context: int | None = None) -> None:
    check_sample(call, vocab_size, context)
    if call.stop_texts and not has_tokenizer:
        raise ValueError("stop strings need the base's tokenizer, which this base lacks; give stop token ids")


def check_adapter_finite(base: BaseModel, adapter: str | None) -> None:
    """A ValueError (the caller's: a bad request) where `adapter`'s weights hold NaN or infinite values (a
    diverged training loop's), which would fail its sampling with torch's 'probability tensor contains either
    inf, nan or element < 0'. Cheap beside a decode: one pass over the adapter's small tensors.
    Unlike a batch job's refusal (`aspen status` says since which step), it cannot name the step the weights went
    non-finite at: a sampler's adapter is a frozen copy known here by its name alone (a snapshot, or weights read
    from a folder), and no model records that step (its optim_step's gradient norm, already a host float, would
    tell it at no cost; the snapshot and the saved sampler's metadata would then have to carry it). The message
    says which of the caller's own metrics tell it."""
    bad, total = (0, 0) if adapter is None else non_finite_values(base.model, adapter)
    if bad:
        raise ValueError(f"the adapter's weights are not finite ({bad} of {total} values are NaN or infinite; its "
                         "training diverged, e.g. a NaN loss or too high a learning rate; the first step whose "
                         "forward_backward answered a NaN or infinite loss, or whose optim_step a NaN or "
                         "infinite grad_norm:mean, is where): load an earlier checkpoint of it (a state saved "
                         "before that step) or train again with a lower learning rate")
