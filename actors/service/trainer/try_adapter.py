""""Try it": one prompt continued greedily through a job's adapter and through the base model alone, side by
side, in one batch of the engine's generation path (actors/engine/generate.py). The trainer runs it between two
fused steps (its actor takes one call at a time): a running job's adapter is exactly the one after its last step;
a finished job's (`try_saved_adapter`) is read from its folder into a frozen adapter on the base for the call only,
as a job's reference adapter is held (actors/engine/job_references.py), so no step and no other job sees it; on a
pipeline trainer each stage holds its share of it (`HeldAdapters`: PipelineEngine.hold_saved). `withdrawn`, asked
between decode steps, stops a generation its caller no longer waits for (`Withdrawn`), freeing the trainer. Ray-free."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from actors.checkpoint.initial_adapter import start_from_adapter
from actors.engine.adapter_surgery import add_adapter, non_finite_values, remove_adapter
from actors.engine.generate import Decoder, greedy_generate_many
from actors.engine.generation_eval import stop_token_ids
from actors.engine.models import BaseModel
from actors.service.scheduler.call_waits import Withdrawn
from actors.spec.job_spec import JobSpec
from actors.spec.saved_adapter import AdapterFileError, read_back_form
from actors.storage.storage_uri import StorageURI

MAX_NEW_TOKENS = 256      # per request: generation holds the trainer's steps meanwhile
MAX_PROMPT_TOKENS = 1024


class HeldAdapters(Protocol):
    """A trainer that holds a saved adapter over several devices for decoding calls (a pipeline's stages)."""

    def hold_saved(self, name: str, spec: JobSpec, location: str | Path | StorageURI) -> None: ...

    def drop_held(self, name: str) -> None: ...

    def decode(self, requests: list, choose: Any, finished: Any) -> None: ...


class NotHere(ValueError):
    """The job is not on this trainer's steps (it has not started here, or it has left)."""


def _continuation(base: BaseModel, tokens: list[int], stops: set[int]) -> str:
    for index, token in enumerate(tokens):   # ends at its first stop token, which is not text
        if token in stops:
            tokens = tokens[:index]
            break
    return base.tokenizer.decode(tokens, skip_special_tokens=True)


def try_adapter(base: BaseModel, adapters: dict[str, Any], job_id: str, step: int, prompt: str,
                max_new_tokens: int, decoder: Decoder | None = None,
                withdrawn: Callable[[], bool] | None = None) -> dict[str, Any]:
    """`prompt` continued by the job's adapter (`adapters`: the trainer's adapter name of each job here) and
    by the base alone: `{"job", "step", "adapter", "base", "prompt_tokens", "new_tokens", "seconds"}`.
    `decoder`: a pipeline's decoding over its stages (`base` then its stage 0's). `withdrawn`: asked between decode
    steps whether the caller still waits; once True, the generation stops there (`Withdrawn`)."""
    if job_id not in adapters:
        raise NotHere(f"job {job_id} is not on this trainer's steps now (it has not started here yet, or it has "
                      "just left); try again while it runs")
    bad, total = non_finite_values(base.model, adapters[job_id])
    if bad:   # greedy decoding through NaN weights answers junk (an empty continuation) as if it were the adapter's
        raise ValueError(f"job {job_id}'s adapter's weights are not finite at step {step} ({bad} of {total} values "
                         "are NaN or infinite): its training diverged (`aspen status` says since which step); "
                         "cancel it and train it again with a lower lr, or from a checkpoint before that step")
    return _side_by_side(base, adapters[job_id], job_id, step, prompt, max_new_tokens, decoder, withdrawn)


def try_saved_adapter(base: BaseModel, spec: JobSpec, location: str | Path | StorageURI, job_id: str, step: int,
                      prompt: str, max_new_tokens: int, stages: HeldAdapters | None = None,
                      withdrawn: Callable[[], bool] | None = None) -> dict[str, Any]:
    """As `try_adapter`, through the adapter a job saved at `location` (its folder; `spec`: the job's, whose `lora`
    it has), attached for this call only (`stages`: held by a pipeline's stages, decoded over them). ValueError where
    the folder cannot be read or does not fit (nothing of it stays on the base)."""
    _prompt_ids(base, prompt, max_new_tokens)   # a bad request is refused before the adapter is read
    name = f"{job_id}@try"
    if stages is not None:
        try:
            stages.hold_saved(name, spec, location)
        except AdapterFileError as error:
            raise _untriable(job_id, error) from None
        try:
            return _side_by_side(base, name, job_id, step, prompt, max_new_tokens, stages.decode, withdrawn)
        finally:
            stages.drop_held(name)
    handle = add_adapter(base.model, name, read_back_form(spec.lora), seed=0)
    try:
        for parameter in handle.parameters():
            parameter.requires_grad_(False)
        try:
            start_from_adapter(handle, location)
        except AdapterFileError as error:
            raise _untriable(job_id, error) from None
        return _side_by_side(base, name, job_id, step, prompt, max_new_tokens, withdrawn=withdrawn)
    finally:
        remove_adapter(base.model, name)


def _untriable(job_id: str, error: AdapterFileError) -> ValueError:
    return ValueError(f"job {job_id}'s adapter cannot be tried: {str(error).removeprefix('init_adapter: ')}")


def _prompt_ids(base: BaseModel, prompt: str, max_new_tokens: int) -> list[int]:
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    ids = list(base.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not prompt.strip() or not ids:
        raise ValueError("the prompt is empty; write something for the adapter to continue")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS} are taken")
    return ids


def _side_by_side(base: BaseModel, adapter: str, job_id: str, step: int, prompt: str, max_new_tokens: int,
                  decoder: Decoder | None = None, withdrawn: Callable[[], bool] | None = None) -> dict[str, Any]:
    ids = _prompt_ids(base, prompt, max_new_tokens)
    started = time.perf_counter()
    stops = stop_token_ids(base)
    seen: list[bool] = []   # the withdrawal, once seen

    def stop() -> bool:
        if not seen and withdrawn is not None and withdrawn():
            seen.append(True)
        return bool(seen)

    tuned, plain = greedy_generate_many(base, [(adapter, ids), (None, ids)], max_new_tokens, stops, decoder=decoder,
                                        stop=stop)
    if seen:
        raise Withdrawn(f"the \"try it\" of job {job_id} was withdrawn (its caller stopped waiting) after "
                        f"{len(tuned)} of at most {max_new_tokens} new tokens; its generation stopped there")
    return {"job": job_id, "step": step, "prompt": prompt, "adapter": _continuation(base, tuned, stops),
            "base": _continuation(base, plain, stops), "prompt_tokens": len(ids),
            "new_tokens": [len(tuned), len(plain)], "seconds": round(time.perf_counter() - started, 3)}
