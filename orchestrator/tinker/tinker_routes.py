"""The Tinker REST API (`/api/v1/...`, as the `tinker` SDK 0.38 calls it) over a trainer's interactive calls
(actors/service/trainer/interactive_calls.py): client config, sessions and heartbeats, server capabilities,
create_model, get_info, forward / forward_backward (protobuf in and out), optim_step,
save_weights_for_sampler (its files, and a frozen copy on the base that sampling sessions sample), sampling
(sampling_routes.py), saved states (state_routes.py), the RestClient's runs and checkpoints
(rest_routes.py), custom losses run on the server (custom_loss_routes.py), and the futures every call returns
(an abandoned sample's cancelled: cancel_future). Requests are read
with the SDK's own types (`tinker.types`, `tinker.proto`).

The key is `X-API-Key: tml-<an aspen user's token>` (the SDK refuses keys without its prefix). A user sees
only their own sessions, models and futures (another's answer 404). A call's problem (a datum the base
cannot take, an unknown loss) fails that call's future with category "user", never its partners' step.
Sampling: orchestrator/tinker/sampling_routes.py. The SDK's calls that make no sense here (projects, audit,
billing, traces, search) answer why and what to use instead (unserved_routes.py); docs/tinker_coverage.md lists
every SDK call. A model's adapter is on the decoder's linear layers (`train_attn`, `train_mlp`) and, with
`train_unembed` (the SDK's default), on the LM head (actors/engine/head_lora.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import Response
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from actors.engine.interactive_model import MAX_RANK, AdamStep
from actors.service.trainer.interactive_calls import adapter_name
from actors.service.trainer.interactive_commands import Refused, SaveSampler
from orchestrator.tinker.answers import SdkJSONResponse, typed
from orchestrator.tinker.checkpoint_ledger import ttl_problem
from orchestrator.tinker.custom_loss_routes import add_custom_loss_routes, with_custom_loss
from orchestrator.tinker.rest_routes import add_rest_routes, keep_run_metadata, run_metadata_problem, run_seed
from orchestrator.tinker.sampling_routes import add_sampling_routes
from orchestrator.tinker.sessions import Session
from orchestrator.tinker.state_routes import add_state_routes, refuse_other_optimizer
from orchestrator.tinker.tinker_backend import TinkerBackend
from orchestrator.tinker.unserved_routes import add_unserved_routes
from orchestrator.tinker.wire import (
    MAX_BODY_BYTES,
    PROTO_TYPE,
    WireError,
    decompress,
    read_forward_backward,
    write_output,
)

KEY_PREFIX = "tml-"
MAX_CALL_DATUMS = 1024          # as the SDK chunks a call (ClientConfigResponse.fwdbwd_max_chunk_len)
MAX_CALL_TOKENS = 1 << 17       # the tokens of one forward(_backward) call
TOKEN_BYTES = 4                 # the SDK's estimate of a model_input token's bytes (its chunks are sized by bytes)


class Context:
    """What every route shares: the backend, the caller's user from the key, ownership, and futures."""

    def __init__(self, backend: TinkerBackend):
        self.backend = backend
        self.sessions, self.calls = backend.sessions, backend.calls

    def user_of(self, x_api_key: str | None) -> str:
        if not x_api_key or not x_api_key.startswith(KEY_PREFIX):
            raise HTTPException(401, f"X-API-Key must be '{KEY_PREFIX}' followed by your aspen token")
        user = self.backend.authenticate(x_api_key.removeprefix(KEY_PREFIX))
        if user is None:
            raise HTTPException(401, "not an aspen token (`aspen user token NAME` prints yours)")
        return user

    def session(self, session_id: str, user: str) -> Session:
        try:
            return self.sessions.get(session_id, user)
        except KeyError as error:
            raise HTTPException(404, str(error)) from None

    def owned(self, model_id: str, user: str) -> str:
        if self.backend.book.owners.get(model_id) != user:
            raise HTTPException(404, f"no model {model_id} of yours")
        return model_id

    @contextlib.contextmanager
    def in_order(self, model_id: str, seq_id: int | None) -> Iterator[None]:
        """A model's call numbered `seq_id` by its SDK: where the route refuses it (an HTTPException), its place in
        the model's order is passed with nothing done, else every later call of the model would wait for it."""
        try:
            yield
        except HTTPException as error:
            try:
                self.calls.submit(model_id, seq_id or 0, "apply", Refused(str(error.detail)))
            except (KeyError, ValueError):
                pass   # the model has ended, or that place was run already: no later call waits for it
            raise

    def future(self, accepted: Future, user: str, answer: Callable[[Any], dict | bytes],
               model_id: str | None = None) -> dict:
        request_id = self.sessions.accept(accepted, user, answer)
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(mode="json",
                                                                                           exclude_none=True)


def done(value: Any) -> Future:
    ready: Future = Future()
    ready.set_result(value)
    return ready


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def tokenizer_for(facts: dict[str, Any], request: Request) -> str | None:
    """Where the SDK's `get_tokenizer()` loads the base's tokenizer from: for a client on this machine (a loopback
    request, not one a reverse proxy forwarded), the folder the base's own tokenizer is read from here, where this
    process sees it (no hub, nothing downloaded: the embedded base's converted folder); elsewhere the base's hub id
    (or folder)."""
    folder = facts.get("tokenizer_folder")
    proxied = any(name in request.headers for name in ("x-forwarded-for", "forwarded", "x-real-ip"))
    local = not proxied and request.client is not None and (request.client.host in LOOPBACK
                                                            or request.client.host.startswith("127."))
    if local and folder and Path(folder).is_dir():
        return folder
    return facts.get("tokenizer_id")


def tinker_router(backend: TinkerBackend) -> APIRouter:
    """The router of every /api/v1 route aspen serves."""
    router = APIRouter(prefix="/api/v1", tags=["tinker"], default_response_class=SdkJSONResponse)
    ctx = Context(backend)

    def user_of(x_api_key: str | None = Header(None)) -> str:
        return ctx.user_of(x_api_key)

    add_session_routes(router, ctx, user_of)
    add_training_routes(router, ctx, user_of)
    add_forward_backward_route(router, ctx, user_of)
    add_future_routes(router, ctx, user_of)
    add_sampling_routes(router, ctx, user_of)
    add_state_routes(router, ctx, user_of)
    add_rest_routes(router, ctx, user_of)
    add_custom_loss_routes(router, ctx, user_of)
    add_unserved_routes(router, user_of)
    return router


def add_session_routes(router: APIRouter, ctx: Context, user_of: Callable[..., str]) -> None:
    """Client config, sessions and their heartbeats, telemetry, capabilities."""
    backend, sessions = ctx.backend, ctx.sessions

    @router.post("/client/config")
    def client_config(body: types.ClientConfigRequest, user: str = Depends(user_of)) -> dict:
        # the SDK splits a larger call into chunks of whole datums, each within these (a token is at least its
        # TOKEN_BYTES in the SDK's estimate of a chunk's bytes): each chunk is within aspen's limits of a call
        config = types.ClientConfigResponse(use_pyqwest_transport=False, proto_compress_fwdbwd=False,
                                            sample_use_retrieve_futures=False, custom_loss_server_side=True,
                                            fwdbwd_max_chunk_len=MAX_CALL_DATUMS,
                                            fwdbwd_max_chunk_bytes_count=MAX_CALL_TOKENS * TOKEN_BYTES)
        return config.model_dump(mode="json", exclude_none=True)

    @router.post("/client/dynamic_config")
    def dynamic_config(user: str = Depends(user_of)) -> dict:
        # an abandoned sample is cancelled (cancel_future)
        return typed(types.ClientDynamicConfigResponse, sample_cancel_enabled=True)

    @router.post("/create_session")
    def create_session(body: types.CreateSessionRequest, user: str = Depends(user_of)) -> dict:
        session = sessions.open(user, body.user_metadata, body.display_name)
        return types.CreateSessionResponse(session_id=session.session_id).model_dump(mode="json", exclude_none=True)

    @router.post("/session_heartbeat")
    def heartbeat(body: types.SessionHeartbeatRequest, user: str = Depends(user_of)) -> dict:
        try:
            sessions.beat(body.session_id, user)
        except KeyError as error:
            raise HTTPException(410, str(error)) from None
        if not backend.local:   # the trainers end a model whose server stopped beating for it
            backend.calls.beat(list(ctx.session(body.session_id, user).models))
        return typed(types.SessionHeartbeatResponse, "session_heartbeat")

    @router.post("/sessions/{session_id}/finish")
    def finish(session_id: str, user: str = Depends(user_of)) -> Response:
        backend.end_session(ctx.session(session_id, user))
        return Response(status_code=204)

    @router.post("/telemetry")
    def telemetry(user: str = Depends(user_of)) -> dict:
        return typed(types.TelemetryResponse, status="accepted")

    @router.get("/get_server_capabilities")
    def capabilities(user: str = Depends(user_of)) -> dict:
        models = [types.SupportedModel(model_name=base, max_context_length=backend.facts(base)["context"],
                                       trainable=True, sampleable=True) for base in backend.bases()]
        return types.GetServerCapabilitiesResponse(supported_models=models).model_dump(mode="json",
                                                                                      exclude_none=True)



def add_training_routes(router: APIRouter, ctx: Context, user_of: Callable[..., str]) -> None:
    """A model's creation, its info, optimizer steps and saves for sampling
    (each answered with a future: `add_future_routes`)."""
    backend, calls = ctx.backend, ctx.calls
    owned, future = ctx.owned, ctx.future

    @router.post("/create_model")
    def create_model(body: types.CreateModelRequest, user: str = Depends(user_of)) -> dict:
        session = ctx.session(body.session_id, user)
        bases = backend.bases()
        if body.base_model not in bases:
            raise HTTPException(404, f"base model '{body.base_model}' is not served here; it serves "
                                     f"{', '.join(repr(b) for b in bases) or 'none now'} (get_server_capabilities)")
        lora = body.lora_config or types.LoraConfig(rank=32)
        if not 1 <= lora.rank <= MAX_RANK:
            raise HTTPException(422, f"lora_config.rank must be between 1 and {MAX_RANK} (got {lora.rank})")
        refuse_other_optimizer(body.optimizer_config)
        run_metadata_problem(body.user_metadata)
        model_id = f"{session.session_id}:train:{body.model_seq_id}"
        seed = run_seed(backend.folder(model_id), lora.seed)   # None: a random seed, as the SDK documents
        try:
            calls.create_model(model_id, lora.rank, owner=user, seed=seed, train_attn=lora.train_attn,
                               train_mlp=lora.train_mlp, base_model=body.base_model,
                               train_unembed=lora.train_unembed)
        except ValueError as error:   # e.g. train_mlp alone on a base whose MLP has no linear layer (MoE)
            raise HTTPException(422, str(error)) from None
        backend.book.owners[model_id] = user
        backend.book.model_bases[model_id] = body.base_model
        keep_run_metadata(backend.folder(model_id), user, body.user_metadata, seed)
        if model_id not in session.models:
            session.models.append(model_id)
        return future(done(model_id), user,
                      lambda mid: types.CreateModelResponse(model_id=mid).model_dump(mode="json"), model_id)

    @router.post("/get_info")
    def get_info(body: types.GetInfoRequest, request: Request, user: str = Depends(user_of)) -> dict:
        model_id = owned(body.model_id, user)
        base = backend.book.model_bases[model_id]
        facts = backend.facts(base)
        return typed(types.GetInfoResponse, "get_info", model_id=model_id, is_lora=True,
                     lora_rank=calls.rank_of(model_id), model_name=base,
                     model_data={"arch": facts["arch"], "model_name": base,
                                 "tokenizer_id": tokenizer_for(facts, request)})

    @router.post("/optim_step")
    def optim_step(body: types.OptimStepRequest, user: str = Depends(user_of)) -> dict:
        model_id = owned(body.model_id, user)
        with ctx.in_order(model_id, body.seq_id):
            return step_adam(model_id, body, user)

    def step_adam(model_id: str, body: types.OptimStepRequest, user: str) -> dict:
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise HTTPException(422, f"optimizer '{getattr(params, 'type', params)}': aspen's models step AdamW "
                                     "(AdamParams)")
        step = AdamStep(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2, eps=params.eps,
                        weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm)
        submitted = calls.submit(model_id, body.seq_id or 0, "optim_step", step)
        return future(submitted, user, lambda metrics: typed(types.OptimStepResponse, "optim_step", metrics=metrics),
                      model_id)

    @router.post("/save_weights_for_sampler")
    def save_for_sampler(body: types.SaveWeightsForSamplerRequest, user: str = Depends(user_of)) -> dict:
        model_id = owned(body.model_id, user)
        with ctx.in_order(model_id, body.seq_id):
            return save_sampler(model_id, body, user)

    def save_sampler(model_id: str, body: types.SaveWeightsForSamplerRequest, user: str) -> dict:
        # save_weights_and_get_sampling_client: ephemeral (no files, as Tinker's are), its copy alone is sampled
        ephemeral = body.path is None and body.sampling_session_seq_id is not None
        name = body.path or (f"ephemeral-{body.seq_id}" if ephemeral else f"step-{body.seq_id}")
        if "/" in name or name in (".", ".."):
            raise HTTPException(422, f"path '{name}' must be a plain name (no '/')")
        if (problem := ttl_problem(body.ttl_seconds)) is not None:
            raise HTTPException(422, problem)
        folder = backend.folder(model_id) / "sampler_weights" / name
        path = f"tinker://{model_id}/sampler_weights/{name}"
        snapshot = adapter_name(f"{model_id}-sampler-{name}")   # the frozen copy its sampling sessions sample
        base = backend.book.model_bases[model_id]
        save = SaveSampler(None if ephemeral else folder, base, model_id, user, path, snapshot)
        backend.book.samplers[path] = (snapshot, user)
        submitted = calls.submit(model_id, body.seq_id or 0, "apply", save)
        if ephemeral:
            backend.keep_ephemeral(model_id, path)
        else:
            backend.ledger.record(path, body.ttl_seconds, body.user_metadata, user)
        answer: dict[str, Any] = {}
        if body.sampling_session_seq_id is not None:   # save_weights_and_get_sampling_client: a session on it
            sampler_id = f"{model_id.split(':train:')[0]}:sample:{body.sampling_session_seq_id}"
            backend.book.sampling_sessions[sampler_id] = (adapter_name(f"{model_id}-sampler-{name}"), user, path)
            with contextlib.suppress(KeyError):   # (its session is the model's: known, if ended meanwhile)
                ctx.sessions.find(model_id.split(":train:")[0], user).samplers.append(sampler_id)
            backend.book.sampler_bases[sampler_id] = backend.book.model_bases[model_id]
            answer["sampling_session_id"] = sampler_id
        return future(submitted, user, lambda saved: typed(types.SaveWeightsForSamplerResponseInternal,
                                                           "save_weights_for_sampler", **answer, path=saved), model_id)


def add_forward_backward_route(router: APIRouter, ctx: Context, user_of: Callable[..., str]) -> None:
    """forward / forward_backward: the SDK's protobuf body read into a call of the model's adapter (with its custom
    loss where it names one), answered with a future of the protobuf output."""
    calls, owned, future = ctx.calls, ctx.owned, ctx.future

    @router.post("/forward_backward")
    async def forward_backward(request: Request, user: str = Depends(user_of)) -> dict:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the body has {len(body)} bytes; aspen takes at most {MAX_BODY_BYTES}")
        try:
            raw = decompress(body, request.headers.get("content-encoding"))
            message = read_forward_backward(raw, adapter_name)
        except WireError as error:
            raise HTTPException(400, str(error)) from None
        model_id = owned(message.model_id, user)
        with ctx.in_order(model_id, message.seq_id):
            message = with_custom_loss(ctx, message, user)
            tokens = sum(len(datum.tokens) for datum in message.call.datums)
            if len(message.call.datums) > MAX_CALL_DATUMS or tokens > MAX_CALL_TOKENS:
                raise HTTPException(413, f"the call has {len(message.call.datums)} datums of {tokens} tokens; aspen "
                                         f"takes at most {MAX_CALL_DATUMS} datums and {MAX_CALL_TOKENS} tokens a call: "
                                         "send fewer at once")
        kind = "forward" if message.forward_only else "forward_backward"
        try:
            submitted = calls.submit(model_id, message.seq_id, kind, message.call)
        except (KeyError, ValueError) as error:
            raise HTTPException(400, str(error)) from None
        return future(submitted, user, write_output, model_id)


def add_future_routes(router: APIRouter, ctx: Context, user_of: Callable[..., str]) -> None:
    """The futures every call returns: pending (try again), failed (the error and whose it is), or its value."""
    sessions = ctx.sessions

    @router.post("/cancel_future")
    def cancel_future(body: types.FutureRetrieveRequest, user: str = Depends(user_of)) -> dict:
        """A sampling request its client abandoned: dropped where it has not started (on a service, on its
        trainer too); one already running finishes, and its answer is dropped. Its future then says which."""
        try:   # on a service, its trainer first, which knows whether it started
            sessions.cancel(body.request_id, user, getattr(ctx.calls, "cancel", None))
        except KeyError as error:
            raise HTTPException(404, str(error)) from None
        except ValueError as error:
            raise HTTPException(400, str(error)) from None
        return {"type": "cancel_future"}

    @router.post("/retrieve_future")
    async def retrieve_future(body: types.FutureRetrieveRequest, user: str = Depends(user_of)) -> Response:
        try:
            state, value = await sessions.retrieve(body.request_id, user)
        except KeyError as error:
            raise HTTPException(404, str(error)) from None
        if state == "pending":
            return SdkJSONResponse(typed(TryAgainResponse, "try_again", request_id=body.request_id,
                                      queue_state="active"), status_code=408)
        if state == "failed":
            category = getattr(value, "category", None) or ("user" if isinstance(value, (ValueError, KeyError))
                                                            else "server")
            return SdkJSONResponse(typed(types.RequestFailedResponse, error=str(value), category=category))
        if isinstance(value, bytes):
            return Response(value, media_type=PROTO_TYPE)
        return SdkJSONResponse(value)   # a diverged loop's NaN metric too (answers.py)
