"""The Tinker API's sampling: sampling sessions (on a model's saved sampler weights, `tinker://<model>/
sampler_weights/<name>`, or on the base alone), `GET samplers/{id}`, and `asample`, whose calls from every
user are decoded together (actors/service/trainer/interactive_calls.py, actors/engine/tinker_sampling.py).
`stop` as the SDK defines it: None stops at the base's end-of-sequence token, [] never, token ids or strings
at those. Of the prompt (actors/engine/prompt_scores.py): its log-probabilities and top-k (`topk_prompt_logprobs`,
top-k distillation's teacher), over the whole prompt or its last `prompt_logprobs_last_n` tokens, chosen tokens'
log-probabilities (`target_prompt_logprobs`, dense or sparse) and alternative draws (`prompt_alt_tokens_k`); the
sampled tokens' top-k. A request that cannot be answered is refused (422), naming the parameter."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, HTTPException
from tinker import types

from actors.engine.prompt_scores import TargetCells
from actors.engine.tinker_sampling import SampleCall
from orchestrator.tinker.wire import write_samples

MAX_SAMPLE_TOKENS = 4096
MAX_SAMPLES = 64


def add_sampling_routes(router: APIRouter, ctx, user_of: Callable[..., str]) -> None:
    backend, sessions, calls = ctx.backend, ctx.sessions, ctx.calls

    @router.post("/create_sampling_session")
    def create_sampling_session(body: types.CreateSamplingSessionRequest, user: str = Depends(user_of)) -> dict:
        session = ctx.session(body.session_id, user)
        adapter, base = None, body.base_model
        if body.model_path is not None:
            backend.sweep_expired()
            found = backend.book.samplers.get(body.model_path)
            if found is None or found[1] != user:
                expired = backend.ledger.expired_note(body.model_path) if found is None else None
                raise HTTPException(404, expired or f"no sampler weights {body.model_path} of yours "
                                                    "(save_weights_for_sampler writes them)")
            adapter = found[0]
            base = backend.book.model_bases.get(body.model_path.removeprefix("tinker://").split("/")[0])
        elif body.base_model not in backend.bases():
            raise HTTPException(404, f"base model '{body.base_model}' is not served here; it serves "
                                     f"{', '.join(repr(b) for b in backend.bases()) or 'none now'}")
        sampler_id = f"{session.session_id}:sample:{body.sampling_session_seq_id}"
        backend.book.sampling_sessions[sampler_id] = (adapter, user, body.model_path)
        backend.book.sampler_bases[sampler_id] = base or ""
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump(mode="json")

    @router.get("/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, user: str = Depends(user_of)) -> dict:
        found = backend.book.sampling_sessions.get(sampler_id)
        if found is None or found[1] != user:
            raise HTTPException(404, f"no sampler {sampler_id} of yours")
        return {"sampler_id": sampler_id, "base_model": backend.book.sampler_bases.get(sampler_id),
                "model_path": found[2]}

    @router.post("/asample")
    def asample(body: types.SampleRequest, user: str = Depends(user_of)) -> dict:
        found = backend.book.sampling_sessions.get(body.sampling_session_id or "")
        if found is None or found[1] != user:
            raise HTTPException(404, f"no sampling session {body.sampling_session_id} of yours")
        base = backend.book.sampler_bases.get(body.sampling_session_id or "", "")
        call = sample_call(body, found[0], backend.facts(base)["eos"])
        model_id = found[2].removeprefix("tinker://").split("/")[0] if found[2] else None
        if model_id is not None and model_id not in backend.book.model_bases:
            raise HTTPException(404, f"model {model_id} has ended: its sampler weights are in its folder (the "
                                     "RestClient lists them), no longer on the base")
        accepted = calls.submit_sample(call, model_id=model_id, base_model=base)
        request_id = sessions.accept(accepted, user, write_samples)
        ids = [f"{body.sampling_session_id}:{body.seq_id}:{index}" for index in range(call.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}


def sample_call(body: types.SampleRequest, adapter: str | None, eos: int | None) -> SampleCall:
    """The request as aspen's sampling call; a parameter aspen does not serve refused (422), naming it."""
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
    max_tokens = params.max_tokens or 256
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
