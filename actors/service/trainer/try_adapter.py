""""Try it": one prompt continued greedily through a running job's current adapter and through the base
model alone, side by side, in one batch of the engine's generation path (actors/engine/generate.py). The
trainer runs it between two fused steps (its actor takes one call at a time), so the adapter is exactly the
one after the job's last step. Ray-free."""

from __future__ import annotations

import time
from typing import Any

from actors.engine.generate import greedy_generate_many
from actors.engine.generation_eval import stop_token_ids
from actors.engine.models import BaseModel

MAX_NEW_TOKENS = 256      # per request: generation holds the trainer's steps meanwhile
MAX_PROMPT_TOKENS = 1024


class NotHere(ValueError):
    """The job is not on this trainer's steps (it has not started here, or it has left)."""


def _continuation(base: BaseModel, tokens: list[int], stops: set[int]) -> str:
    for index, token in enumerate(tokens):   # ends at its first stop token, which is not text
        if token in stops:
            tokens = tokens[:index]
            break
    return base.tokenizer.decode(tokens, skip_special_tokens=True)


def try_adapter(base: BaseModel, adapters: dict[str, Any], job_id: str, step: int, prompt: str,
                max_new_tokens: int) -> dict[str, Any]:
    """`prompt` continued by the job's adapter (`adapters`: the trainer's adapter name of each job here) and
    by the base alone: `{"job", "step", "adapter", "base", "prompt_tokens", "new_tokens", "seconds"}`."""
    if job_id not in adapters:
        raise NotHere(f"job {job_id} is not on this trainer's steps now (it has not started here yet, or it has "
                      "just left); try again while it runs")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    ids = list(base.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not prompt.strip() or not ids:
        raise ValueError("the prompt is empty; write something for the adapter to continue")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS} are taken")
    started = time.perf_counter()
    stops = stop_token_ids(base)
    tuned, plain = greedy_generate_many(base, [(adapters[job_id], ids), (None, ids)], max_new_tokens, stops)
    return {"job": job_id, "step": step, "prompt": prompt, "adapter": _continuation(base, tuned, stops),
            "base": _continuation(base, plain, stops), "prompt_tokens": len(ids),
            "new_tokens": [len(tuned), len(plain)], "seconds": round(time.perf_counter() - started, 3)}
