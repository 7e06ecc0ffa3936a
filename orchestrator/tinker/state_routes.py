"""The Tinker API's saved states: `save_weights` (a model's adapter and AdamW state, `tinker://<model>/weights/
<name>`) and `load_weights` into a model (its weights, and its optimizer's state when asked), or into a new one
that the load creates (`create_training_client_from_state`: the rank comes from the state). A user loads their
own states and published ones (another's unpublished state is 404). A save's `ttl_seconds` and `user_metadata`
go in the checkpoint ledger (checkpoint_ledger.py); a state whose time has passed is deleted, and loading it says
when it expired."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException
from tinker import types

from actors.checkpoint.interactive_state import base_name, read_state
from actors.engine.interactive_model import trained_parts
from actors.service.scheduler.interactive_jobs import model_folder
from actors.service.trainer.interactive_commands import LoadState, SaveState
from orchestrator.tinker.answers import typed
from orchestrator.tinker.checkpoint_ledger import ttl_problem
from orchestrator.tinker.rest_routes import keep_run_metadata, recorded_seed, run_metadata_problem


def refuse_other_optimizer(config: types.OptimizerConfig | None) -> None:
    """422 for an `optimizer_config` (create_lora_training_client's or create_training_client_from_state's
    `optimizer=`) of another family than AdamW: aspen trains with AdamW alone (it was silently trained so)."""
    if config is not None and config.type != "adamw":
        raise HTTPException(422, f"optimizer_config asks for the '{config.type}' optimizer: aspen trains with AdamW "
                                 "only (types.AdamOptimizerConfig, the SDK's default); create the training client "
                                 "without optimizer=, or with AdamOptimizerConfig()")


def state_folder(weights_dir: Path, path: str) -> tuple[str, Path]:
    """(the model id, the folder) of a `tinker://<model>/weights/<name>` path; 404 for any other path."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights" or parts[2] in ("", ".", ".."):
        raise HTTPException(404, f"'{path}' is not a saved state's path (tinker://<model>/weights/<name>)")
    return parts[0], model_folder(weights_dir, parts[0]) / "weights" / parts[2]


def add_state_routes(router: APIRouter, ctx: Any, user_of: Callable[..., str]) -> None:
    backend, sessions, calls = ctx.backend, ctx.sessions, ctx.calls

    @router.post("/save_weights")
    def save_weights(body: types.SaveWeightsRequest, user: str = Depends(user_of)) -> dict:
        model_id = ctx.owned(body.model_id, user)
        path = f"tinker://{model_id}/weights/{body.path or f'step-{body.seq_id}'}"
        with ctx.in_order(model_id, body.seq_id):
            _, folder = state_folder(backend.weights_dir, path)
            if folder.exists() and not body.overwrite:
                raise HTTPException(422, f"{path} exists; save under another name, or with overwrite")
            if (problem := ttl_problem(body.ttl_seconds)) is not None:
                raise HTTPException(422, problem)
        save = SaveState(folder, backend.book.model_bases[model_id], model_id, user, path)
        submitted = calls.submit(model_id, body.seq_id or 0, "apply", save)
        backend.ledger.record(path, body.ttl_seconds, body.user_metadata, user)
        return ctx.future(submitted, user, lambda saved: typed(types.SaveWeightsResponse, "save_weights", path=saved),
                          model_id)

    @router.post("/load_weights")
    def load_weights(body: types.LoadWeightsRequest, user: str = Depends(user_of)) -> dict:
        if body.session_id is not None:   # create-via-load: no model yet, so no call of one waits for this
            return load(body, user)
        with ctx.in_order(ctx.owned(body.model_id or "", user), body.seq_id):
            return load(body, user)

    def load(body: types.LoadWeightsRequest, user: str) -> dict:
        _, folder = state_folder(backend.weights_dir, body.path)
        backend.sweep_expired()
        try:
            facts, weights, optimizer = read_state(folder)
        except FileNotFoundError:
            raise HTTPException(404, backend.ledger.gone_note(body.path, user) or f"no saved state {body.path} of yours"
                                ) from None
        except ValueError as error:
            raise HTTPException(422, str(error)) from None
        if facts.get("user") != user and not backend.ledger.public(body.path):
            raise HTTPException(404, f"no saved state {body.path} of yours")
        if body.session_id is not None:   # create-via-load: this load is the new model's first call
            refuse_other_optimizer(body.optimizer_config)
            run_metadata_problem(body.user_metadata)
            try:
                session = sessions.get(body.session_id, user)
            except KeyError as error:
                raise HTTPException(404, str(error)) from None
            model_id, seq_id = f"{session.session_id}:train:{body.model_seq_id}", 0
            base = base_name(facts) or backend.base_model
            if base not in backend.bases():
                raise HTTPException(404, f"{body.path} was trained on '{base}', which is not served here now")
            # the parts the saved model trained (its tensors' names), so that its state loads whole
            calls.create_model(model_id, facts["rank"], owner=user, first_seq=0, base_model=base,
                               **trained_parts(list(weights)))
            backend.book.owners[model_id] = user
            backend.book.model_bases[model_id] = base
            keep_run_metadata(backend.folder(model_id), user, body.user_metadata,
                              recorded_seed(backend.folder(state_folder(backend.weights_dir, body.path)[0])),
                              {"from_state": body.path, "with_optimizer": bool(body.optimizer)})
            if model_id not in session.models:
                session.models.append(model_id)
        else:
            model_id, seq_id = ctx.owned(body.model_id or "", user), body.seq_id or 0

        load = LoadState(model_id, weights, optimizer if body.optimizer else None, int(facts.get("steps", 0)))
        submitted = calls.submit(model_id, seq_id, "apply", load)
        return ctx.future(submitted, user, lambda loaded: typed(types.LoadWeightsResponse, "load_weights",
                                                                path=body.path, model_id=loaded), model_id)
