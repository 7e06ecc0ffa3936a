"""The Tinker API's sampling: sampling sessions (on a model's saved sampler weights, `tinker://<model>/
sampler_weights/<name>`, the user's own or published ones, or on the base alone), `GET samplers/{id}`, and
`asample`, whose calls from every user are decoded together (actors/service/trainer/interactive_calls.py,
actors/engine/tinker_sampling.py).
`stop` as the SDK defines it: None stops at the base's end-of-sequence token, [] never, token ids or strings
at those. Of the prompt (actors/engine/prompt_scores.py): its log-probabilities and top-k (`topk_prompt_logprobs`,
top-k distillation's teacher), over the whole prompt or its last `prompt_logprobs_last_n` tokens, chosen tokens'
log-probabilities (`target_prompt_logprobs`, dense or sparse) and alternative draws (`prompt_alt_tokens_k`); the
sampled tokens' top-k. A request that cannot be answered is refused (422), naming the parameter. Sampler weights
are sampled through their model's frozen copy while the model lives, and read back from their files after it
(held_samplers.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException
from tinker import types

from actors.checkpoint.interactive_state import base_name
from actors.checkpoint.peft_io import METADATA_NAME
from actors.engine.prompt_scores import TargetCells
from actors.engine.tinker_sampling import SampleCall
from actors.service.scheduler.interactive_jobs import model_folder
from orchestrator.tinker.answers import typed
from orchestrator.tinker.wire import write_samples

MAX_SAMPLE_TOKENS = 4096
MAX_SAMPLES = 64
DEFAULT_MAX_TOKENS = 256   # a sample's tokens where its SamplingParams set no max_tokens


def add_sampling_routes(router: APIRouter, ctx, user_of: Callable[..., str]) -> None:
    backend, sessions, calls = ctx.backend, ctx.sessions, ctx.calls

    @router.post("/create_sampling_session")
    def create_sampling_session(body: types.CreateSamplingSessionRequest, user: str = Depends(user_of)) -> dict:
        session = ctx.session(body.session_id, user)
        adapter, base = None, body.base_model
        sampler_id = f"{session.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is not None:
            backend.sweep_expired()
            found = backend.book.samplers.get(body.model_path)
            if found is not None and (found[1] == user or backend.ledger.public(body.model_path)):
                adapter = found[0]
                if found[1] != user:
                    backend.book.borrowed.add(sampler_id)
                base = backend.book.model_bases.get(body.model_path.removeprefix("tinker://").split("/")[0])
            elif (dropped := backend.dropped_note(body.model_path)) is not None:
                raise HTTPException(404, dropped)
            else:   # its model has ended, or the server restarted: its saved files read back onto a trainer
                adapter, base = read_back(body.model_path, user, sampler_id)
        elif body.base_model not in backend.bases():
            raise HTTPException(404, f"base model '{body.base_model}' is not served here; it serves "
                                     f"{', '.join(repr(b) for b in backend.bases()) or 'none now'}")
        backend.book.sampling_sessions[sampler_id] = (adapter, user, body.model_path)
        session.samplers.append(sampler_id)
        backend.book.sampler_bases[sampler_id] = base or ""
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump(mode="json")

    def read_back(path: str, user: str, sampler_id: str) -> tuple[str, str]:
        """(the adapter, its base) of saved sampler weights read back from their files for `sampler_id`: the
        user's own, or published ones (404 otherwise, or where expired)."""
        folder = sampler_folder(backend.weights_dir, path)
        try:
            facts = json.loads((folder / METADATA_NAME).read_text())
        except (OSError, ValueError):
            raise HTTPException(404, backend.ledger.gone_note(path, user) or not_yours(path)) from None
        if facts.get("user") != user and not backend.ledger.public(path):
            raise HTTPException(404, not_yours(path))
        if facts.get("user") != user:
            backend.book.borrowed.add(sampler_id)
        base = base_name(facts) or ""
        if base not in backend.bases():
            raise HTTPException(404, f"{path} was trained on '{base}', which is not served here now")
        return backend.held.hold(path, str(folder), base, sampler_id).adapter, base

    @router.get("/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, user: str = Depends(user_of)) -> dict:
        found = backend.book.sampling_sessions.get(sampler_id)
        if found is None or found[1] != user:
            raise HTTPException(404, f"no sampler {sampler_id} of yours")
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=backend.book.sampler_bases.get(sampler_id),
                                        model_path=found[2]).model_dump(mode="json")

    @router.post("/asample")
    def asample(body: types.SampleRequest, user: str = Depends(user_of)) -> dict:
        sampler_id = body.sampling_session_id or ""
        found = backend.book.sampling_sessions.get(sampler_id)
        if found is None or found[1] != user:
            raise HTTPException(404, f"no sampling session {body.sampling_session_id} of yours")
        adapter, path = found[0], found[2]
        if sampler_id in backend.book.borrowed and not backend.ledger.public(path):   # its owner unpublished it
            raise HTTPException(404, not_yours(path))
        base = backend.book.sampler_bases.get(sampler_id, "")
        model_id, trainer = None, None
        if path is not None and path in backend.book.samplers:   # its model's frozen copy, on the model's trainer
            model_id = path.removeprefix("tinker://").split("/")[0]
        elif path is not None and backend.ledger.gone(path):   # deleted, or expired: said to its owner alone
            raise HTTPException(404, backend.ledger.gone_note(path, user) or not_yours(path))
        elif (dropped := backend.dropped_note(path)) is not None:
            raise HTTPException(404, dropped)
        elif path is not None:   # read back from its files (its model ended since the session began: now)
            held = backend.held.hold(path, str(sampler_folder(backend.weights_dir, path)), base, sampler_id)
            adapter, trainer = held.adapter, held.trainer
        facts = backend.facts(base)
        call = sample_call(body, adapter, facts["eos"], facts["context"])
        accepted = calls.submit_sample(call, model_id=model_id, base_model=base, trainer=trainer)
        request_id = sessions.accept(accepted, user, write_samples, cancellable=True)
        ids = [f"{body.sampling_session_id}:{body.seq_id}:{index}" for index in range(call.num_samples)]
        return typed(types.UntypedAPIFuture, request_id=request_id, sample_sequence_ids=ids)


def not_yours(path: str) -> str:
    """What a user is told of sampler weights that are not theirs and not published (or do not exist)."""
    return f"no sampler weights {path} of yours (save_weights_for_sampler writes them)"


def sampler_folder(weights_dir: Path, path: str) -> Path:
    """The folder of a `tinker://<model>/sampler_weights/<name>` path; 404 for any other path."""
    parts = path.removeprefix("tinker://").split("/")
    if (not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "sampler_weights"
            or parts[2] in ("", ".", "..")):
        raise HTTPException(404, f"'{path}' is not a sampler weights path (tinker://<model>/sampler_weights/<name>)")
    return model_folder(weights_dir, parts[0]) / "sampler_weights" / parts[2]


def sample_call(body: types.SampleRequest, adapter: str | None, eos: int | None,
                context: int | None = None) -> SampleCall:
    """The request as aspen's sampling call; a parameter aspen does not serve refused (422), naming it. No
    `max_tokens`: DEFAULT_MAX_TOKENS, or as many as the base's `context` has room for after the prompt (the last
    sampled token is never fed), at least one (a prompt past the context is refused as it is)."""
    if body.prompt_logprobs_last_n is not None and not (body.prompt_logprobs or body.topk_prompt_logprobs):
        raise HTTPException(422, "prompt_logprobs_last_n scores the prompt's last tokens: ask for prompt_logprobs "
                                 "(or topk_prompt_logprobs) too")
    tokens: list[int] = []
    for chunk in body.prompt.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise HTTPException(422, f"a {getattr(chunk, 'type', 'non-text')} chunk: aspen samples from text only")
        tokens.extend(chunk.tokens)
    params = body.sampling_params
    stop = params.stop
    stop_tokens: frozenset[int] = frozenset()
    stop_texts: tuple[str, ...] = ()
    if stop is None:
        stop_tokens = frozenset() if eos is None else frozenset({eos})
    elif isinstance(stop, str):
        stop_texts = (stop,)
    elif stop and all(isinstance(s, int) for s in stop):
        stop_tokens = frozenset(stop)
    elif stop:
        stop_texts = tuple(str(s) for s in stop)
    max_tokens = params.max_tokens   # 0 is refused below, not made the default
    if max_tokens is None:
        room = DEFAULT_MAX_TOKENS if context is None else context - len(tokens) + 1
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
    if not 1 <= max_tokens <= MAX_SAMPLE_TOKENS or not 1 <= body.num_samples <= MAX_SAMPLES:
        raise HTTPException(422, f"max_tokens must be 1..{MAX_SAMPLE_TOKENS} and num_samples 1..{MAX_SAMPLES}")
    return SampleCall(adapter, tuple(tokens), num_samples=body.num_samples, max_tokens=max_tokens,
                      temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                      stop_tokens=stop_tokens, stop_texts=stop_texts, prompt_logprobs=bool(body.prompt_logprobs),
                      topk_prompt=body.topk_prompt_logprobs or 0, topk_sample=body.topk_sample_logprobs or 0,
                      prompt_last_n=body.prompt_logprobs_last_n, alt_k=body.prompt_alt_tokens_k or 0,
                      target_cells=target_cells(body.target_prompt_logprobs))


def target_cells(asked) -> TargetCells | None:
    """`target_prompt_logprobs` (the SDK's TensorData: int64 (len(prompt) - 1, K), dense with -1 for no token, or
    sparse CSR) as the cells it asks for; 422 naming what is wrong with it."""
    if asked is None:
        return None
    shape = list(asked.shape or [])
    if len(shape) != 2 or asked.dtype != "int64":
        raise HTTPException(422, f"target_prompt_logprobs must be int64 of shape (len(prompt) - 1, K), not "
                                 f"{asked.dtype} {shape}")
    data = [int(value) for value in asked.data]
    if asked.sparse_crow_indices is not None:
        crow, columns = list(asked.sparse_crow_indices), list(asked.sparse_col_indices or [])
        if len(crow) != shape[0] + 1 or len(columns) != len(data) or crow[-1] != len(data):
            raise HTTPException(422, "target_prompt_logprobs: its CSR indices do not fit its shape and values")
        cells = tuple((row, columns[index], data[index]) for row in range(shape[0])
                      for index in range(crow[row], crow[row + 1]) if data[index] != -1)
        return TargetCells((shape[0], shape[1]), cells, (tuple(crow), tuple(columns)))
    if len(data) != shape[0] * shape[1]:
        raise HTTPException(422, f"target_prompt_logprobs: {len(data)} values for its shape {shape}")
    cells = tuple((index // shape[1], index % shape[1], token) for index, token in enumerate(data) if token != -1)
    return TargetCells((shape[0], shape[1]), cells)
