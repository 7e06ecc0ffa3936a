"""The Tinker SDK's RestClient on aspen: a user's training runs (a run is a model; listed a page at a time) and their
checkpoints (saved states and sampler weights, as written under the weights folder), the user's sessions (those this
server has seen since it started) and each one's runs and samplers, a path's weights info, deleting a checkpoint,
setting its time to live, and publishing it (other users may then load it, sample it, read its weights info and
list its run with `access_scope=accessible`; only its owner publishes or deletes it). Read from the files
themselves (each folder's aspen.json / interactive_state.json names its model and user), so a restarted server
lists what was saved before; another user's runs and unpublished paths are 404."""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Response
from safetensors import safe_open
from tinker import types

from actors.checkpoint.interactive_state import STATE_FILE, base_name
from actors.checkpoint.peft_io import METADATA_NAME, PREFIX
from actors.engine.interactive_model import trained_parts
from actors.storage.durable import write_durably
from orchestrator.tinker.checkpoint_ledger import CheckpointLedger, ttl_problem
from orchestrator.tinker.copy_routes import add_copy_routes
from orchestrator.tinker.external_weights import add_external_routes

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_FILE = "training_run.json"   # in a model's folder: its user, the user_metadata and the seed it was created with


def run_metadata_problem(metadata: dict[str, Any] | None) -> None:
    """422 for a training run's `user_metadata` that is not strings by strings (the SDK's TrainingRun holds no
    other), naming the key."""
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise HTTPException(422, f"user_metadata['{key}'] is {value!r}: a training run's metadata values are "
                                     "strings; pass str(value)")


def run_seed(folder: Path, asked: int | None) -> int:
    """The seed a new model's LoRA weights start from: `asked` (LoraConfig.seed), or where the SDK left it None
    (its "random seed"), the one drawn at the first create_model of this model (its run file's, so that the SDK's
    retry of the same create gets the same), else a fresh random one."""
    if asked is not None:
        return asked
    kept = recorded_seed(folder)
    return secrets.randbelow(2**31) if kept is None else kept


def keep_run_metadata(folder: Path, user: str, metadata: dict[str, str] | None, seed: int | None = None,
                      origin: dict[str, Any] | None = None) -> None:
    """The `user_metadata` a training run was created with (create_lora_training_client's,
    create_training_client_from_state's), kept in its model's folder for get_training_run and list_training_runs,
    also after its model ended or the server restarted; with the `seed` its LoRA weights started from (a drawn
    one too: the run is reproduced with create_lora_training_client(seed=...)), and for a run created from a
    state, `origin`: the state's path and whether its optimizer's state was loaded (what reproduces it: its
    weights are the state's; its `seed`, the original run's, is where that one started)."""
    if metadata or seed is not None or origin:
        folder.mkdir(parents=True, exist_ok=True)
        facts = {"user": user, "user_metadata": metadata or None} | ({"seed": seed} if seed is not None else {})
        write_durably(folder / RUN_FILE, json.dumps(facts | (origin or {})))


def recorded_seed(folder: Path) -> int | None:
    """The seed run `folder`'s LoRA weights started from, as its run file keeps it (None: none kept)."""
    try:
        return int(json.loads((folder / RUN_FILE).read_text())["seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_metadata(folder: Path, user: str) -> dict[str, str] | None:
    """The `user_metadata` run `folder` was created with by `user` (None: none, or another user's)."""
    try:
        facts = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return facts.get("user_metadata") if facts.get("user") == user else None


def saved_checkpoints(weights_dir: Path) -> Iterator[tuple[dict, Path, str, str]]:
    """(its facts: model_id, user, lora_rank; its folder; its kind folder; its name) of every checkpoint."""
    for kind in KINDS:
        for folder in sorted(weights_dir.glob(f"*/{kind}/*")):
            if folder.name.startswith("."):
                continue   # an external save's adapter, being merged (external_weights.py)
            facts_file = folder / (STATE_FILE if kind == "weights" else METADATA_NAME)
            try:
                facts = json.loads(facts_file.read_text())
            except (OSError, ValueError):
                continue   # a save still being written, or not one of aspen's
            if "rank" in facts:
                facts["lora_rank"] = facts["rank"]
            yield facts, folder, kind, folder.name


def trained_parts_of(folder: Path) -> dict[str, bool]:
    """`train_attn`, `train_mlp`, `train_unembed` of a checkpoint's adapter, from its tensors' names (none for a
    folder without one: external weights, merged)."""
    adapter = folder / "adapter_model.safetensors"
    if not adapter.is_file():
        return {}
    with safe_open(adapter, "pt") as weights:
        return trained_parts([name.removeprefix(PREFIX) for name in weights.keys()])


def checkpoint_of(facts: dict, folder: Path, kind: str, name: str, ledger: CheckpointLedger) -> types.Checkpoint:
    """The SDK's record of a checkpoint: its files' size and time, and what its save asked to keep with it (its
    time to live, the user's metadata: `ledger`)."""
    size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    when = datetime.fromtimestamp(folder.stat().st_mtime, UTC)
    path = f"tinker://{facts['model_id']}/{kind}/{name}"
    return types.Checkpoint(checkpoint_id=f"{kind}/{name}", checkpoint_type=KINDS[kind], time=when,
                            tinker_path=path, size_bytes=size, public=ledger.public(path),
                            expires_at=ledger.expires_at(path), user_metadata=ledger.user_metadata(path))


def add_rest_routes(router: APIRouter, ctx: Any, user_of: Callable[..., str]) -> None:
    backend = ctx.backend

    def own(user: str) -> list[tuple[dict, Path, str, str]]:
        backend.sweep_expired()   # none whose time to live has passed
        return [entry for entry in saved_checkpoints(backend.weights_dir) if entry[0].get("user") == user]

    def run_of(run_id: str, user: str, entries: list[tuple[dict, Path, str, str]] | None = None) -> types.TrainingRun:
        """The run as its owner `user` sees it (`entries`: its checkpoints, read afresh where not given)."""
        mine = [entry for entry in (own(user) if entries is None else entries) if entry[0].get("model_id") == run_id]
        live = backend.book.owners.get(run_id) == user
        if not mine and not live:
            raise HTTPException(404, f"no training run {run_id} of yours")
        checkpoints = sorted((checkpoint_of(*entry, backend.ledger) for entry in mine), key=lambda c: c.time)
        training = [c for c in checkpoints if c.checkpoint_type == "training"]
        sampler = [c for c in checkpoints if c.checkpoint_type == "sampler"]
        rank = next((entry[0].get("lora_rank") for entry in mine), None)
        if live and ctx.calls.rank_of(run_id) is not None:
            rank = ctx.calls.rank_of(run_id)
        base = backend.book.model_bases.get(run_id) or next((base_name(entry[0]) for entry in mine), None)
        last = max([c.time for c in checkpoints], default=datetime.now(UTC))
        return types.TrainingRun(training_run_id=run_id, base_model=base or "", model_owner=user,
                                 is_lora=True, lora_rank=rank, last_request_time=last,
                                 last_checkpoint=training[-1] if training else None,
                                 last_sampler_checkpoint=sampler[-1] if sampler else None,
                                 user_metadata=run_metadata(backend.folder(run_id), user))

    add_run_listing(router, ctx, user_of, own, run_of)
    add_session_listing(router, ctx, user_of)

    @router.get("/training_runs/{run_id}")
    def training_run(run_id: str, access_scope: str = "owned", user: str = Depends(user_of)) -> dict:
        """The user's run; with `accessible`, also another user's run with a published checkpoint (as
        list_training_runs(access_scope="accessible") lists it: its published checkpoints alone)."""
        if access_scope not in ("owned", "accessible"):
            raise HTTPException(422, f"access_scope '{access_scope}' (owned or accessible)")
        if access_scope == "accessible" and backend.book.owners.get(run_id) != user and not any(
                entry[0].get("model_id") == run_id for entry in own(user)):
            if published := published_entries(backend, run_id, user):
                return run_of(run_id, published[0][0]["user"], published).model_dump(mode="json")
        return run_of(run_id, user).model_dump(mode="json")

    @router.get("/training_runs/{run_id}/checkpoints")
    def run_checkpoints(run_id: str, user: str = Depends(user_of)) -> dict:
        run_of(run_id, user)
        found = [checkpoint_of(*entry, backend.ledger) for entry in own(user) if entry[0].get("model_id") == run_id]
        return types.CheckpointsListResponse(checkpoints=found).model_dump(mode="json")

    @router.get("/checkpoints")
    def all_checkpoints(limit: int = 100, offset: int = 0, user: str = Depends(user_of)) -> dict:
        """list_user_checkpoints: the user's checkpoints of every run, the newest first, a page of them."""
        if limit < 1 or offset < 0:
            raise HTTPException(422, f"limit {limit} (at least 1), offset {offset} (at least 0)")
        found = sorted((checkpoint_of(*entry, backend.ledger) for entry in own(user)),
                       key=lambda checkpoint: (checkpoint.time, checkpoint.tinker_path), reverse=True)
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(found))
        return types.CheckpointsListResponse(checkpoints=found[offset:offset + limit], cursor=cursor
                                             ).model_dump(mode="json")

    def readable_entry(path: str, user: str) -> tuple[dict, Path]:
        """(its facts, its folder) of a checkpoint the user may read: their own, or a published one; 404 otherwise."""
        backend.sweep_expired()
        for facts, folder, kind, name in saved_checkpoints(backend.weights_dir):
            if f"tinker://{facts.get('model_id')}/{kind}/{name}" == path and (
                    facts.get("user") == user or backend.ledger.public(path)):
                return facts, folder
        raise HTTPException(404, backend.ledger.gone_note(path, user) or f"no checkpoint {path} of yours")

    @router.post("/weights_info")
    def weights_info(body: dict, user: str = Depends(user_of)) -> dict:
        facts, folder = readable_entry(str(body.get("tinker_path", "")), user)
        parts = {"train_unembed": bool(facts.get("train_unembed", False)), **trained_parts_of(folder)}
        return types.WeightsInfoResponse(base_model=base_name(facts) or "", is_lora=True,
                                         lora_rank=facts.get("lora_rank"), **parts
                                         ).model_dump(mode="json", exclude_none=True)

    def checkpoint(run_id: str, checkpoint_id: str, user: str) -> tuple[Path, str]:
        """(the folder, the tinker:// path) of the user's own checkpoint; 404 for another's or none (to its owner,
        one deleted or expired says when)."""
        path = f"tinker://{run_id}/{checkpoint_id}"
        for facts, folder, kind, name in own(user):
            if facts.get("model_id") == run_id and f"{kind}/{name}" == checkpoint_id:
                return folder, path
        raise HTTPException(404, backend.ledger.gone_note(path, user)
                            or f"no checkpoint {checkpoint_id} of run {run_id} of yours")

    add_checkpoint_settings(router, ctx, user_of, checkpoint)

    add_external_routes(router, ctx, user_of, lambda path, user: readable_entry(path, user)[1])
    add_copy_routes(router, ctx, user_of, readable_entry,
                    lambda user: [entry[1] for entry in own(user)], keep_run_metadata)

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    def delete_checkpoint(run_id: str, checkpoint_id: str, user: str = Depends(user_of)) -> Response:
        folder, path = checkpoint(run_id, checkpoint_id, user)
        shutil.rmtree(folder)
        backend.forget_sampler(path)
        backend.ledger.forget(path, user)
        return Response(status_code=204)


def published_entries(backend: Any, run_id: str, user: str) -> list[tuple[dict, Path, str, str]]:
    """The published checkpoints of another user's run `run_id` (saved_checkpoints' entries), as `user` may read
    them."""
    return [entry for entry in saved_checkpoints(backend.weights_dir)
            if entry[0].get("model_id") == run_id and entry[0].get("user") != user
            and backend.ledger.public(f"tinker://{run_id}/{entry[2]}/{entry[3]}")]


def add_session_listing(router: APIRouter, ctx: Any, user_of: Callable[..., str]) -> None:
    """list_sessions and get_session: the user's sessions this server has seen since it started; with
    `access_scope="accessible"`, as list_training_runs lists runs, also another user's session holding a run with a
    published checkpoint (its published runs alone: no samplers)."""

    def shared(user: str) -> set[str]:
        """The runs of other users that have a published checkpoint."""
        ctx.backend.sweep_expired()
        return {facts["model_id"] for facts, _, kind, name in saved_checkpoints(ctx.backend.weights_dir)
                if facts.get("user") != user and facts.get("model_id")
                and ctx.backend.ledger.public(f"tinker://{facts['model_id']}/{kind}/{name}")}

    def scoped(access_scope: str, user: str) -> Callable[[Any], list[str] | None]:
        """What of a session `user` sees with `access_scope`: all its runs (their own), another's published runs
        (with `accessible`, where it holds one), else None (not theirs to see)."""
        if access_scope not in ("owned", "accessible"):
            raise HTTPException(422, f"access_scope '{access_scope}' (owned or accessible)")
        published = shared(user) if access_scope == "accessible" else set()

        def seen(session: Any) -> list[str] | None:
            if session.user == user:
                return list(session.models)
            return [model for model in session.models if model in published] or None
        return seen

    @router.get("/sessions")
    def list_sessions(limit: int = 20, offset: int = 0, access_scope: str = "owned",
                      user: str = Depends(user_of)) -> dict:
        """The ids of the user's sessions this server has seen since it started (live or ended), newest first;
        with `accessible`, also other users' sessions holding a published run."""
        if limit < 1 or offset < 0:
            raise HTTPException(422, f"limit {limit} (at least 1), offset {offset} (at least 0)")
        seen = scoped(access_scope, user)
        ids = [session.session_id for session in ctx.sessions.every() if seen(session) is not None]
        return types.ListSessionsResponse(sessions=ids[offset:offset + limit]).model_dump(mode="json")

    @router.get("/sessions/{session_id}")
    def get_session(session_id: str, access_scope: str = "owned", user: str = Depends(user_of)) -> dict:
        seen = scoped(access_scope, user)
        found = next((session for session in ctx.sessions.every() if session.session_id == session_id), None)
        runs = None if found is None else seen(found)
        if found is None or runs is None:
            raise HTTPException(404, ctx.sessions.no_session(session_id))
        samplers = list(found.samplers) if found.user == user else []
        return types.GetSessionResponse(training_run_ids=runs, sampler_ids=samplers,
                                        user_metadata=found.user_metadata, display_name=found.display_name
                                        ).model_dump(mode="json")


def add_checkpoint_settings(router: APIRouter, ctx: Any, user_of: Callable[..., str],
                            checkpoint: Callable[[str, str, str], tuple[Path, str]]) -> None:
    """Publishing a checkpoint and setting its time to live (`checkpoint`: the user's own, else 404)."""
    backend = ctx.backend

    def make_public(run_id: str, checkpoint_id: str, user: str, public: bool) -> Response:
        _, path = checkpoint(run_id, checkpoint_id, user)
        if not backend.ledger.set_public(path, public, user):
            raise HTTPException(409, f"{path} is {'public' if public else 'private'} already")
        return Response(status_code=204)

    # before the deletion's route, whose {checkpoint_id:path} would take ".../publish" for its own
    @router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    def publish(run_id: str, checkpoint_id: str, user: str = Depends(user_of)) -> Response:
        return make_public(run_id, checkpoint_id, user, True)

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    def unpublish(run_id: str, checkpoint_id: str, user: str = Depends(user_of)) -> Response:
        return make_public(run_id, checkpoint_id, user, False)

    @router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    def set_ttl(run_id: str, checkpoint_id: str, body: dict, user: str = Depends(user_of)) -> Response:
        _, path = checkpoint(run_id, checkpoint_id, user)
        ttl_seconds = body.get("ttl_seconds")
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int)):
            raise HTTPException(400, f"ttl_seconds is {ttl_seconds!r}: a whole number of seconds, or null (never)")
        if (problem := ttl_problem(ttl_seconds)) is not None:
            raise HTTPException(400, problem)
        backend.ledger.set_ttl(path, ttl_seconds, user)
        return Response(status_code=204)


def add_run_listing(router: APIRouter, ctx: Any, user_of: Callable[..., str],
                    own: Callable[[str], list[tuple[dict, Path, str, str]]], run_of: Callable[..., types.TrainingRun]
                    ) -> None:
    """list_training_runs: the user's runs (`own`: their checkpoints; `run_of`: a run as its owner sees it)."""
    backend = ctx.backend

    @router.get("/training_runs")
    def training_runs(limit: int = 20, offset: int = 0, access_scope: str = "owned", project_id: str | None = None,
                      user: str = Depends(user_of)) -> dict:
        """The user's runs (with `accessible`, also other users' runs with a published checkpoint, those alone),
        the most recent first, a page of them."""
        if project_id is not None:
            raise HTTPException(422, f"project_id '{project_id}': aspen has no projects; list without one")
        if access_scope not in ("owned", "accessible") or limit < 1 or offset < 0:
            raise HTTPException(422, f"limit {limit} (at least 1), offset {offset} (at least 0), access_scope "
                                     f"'{access_scope}' (owned or accessible)")
        entries = own(user)
        ids = {entry[0].get("model_id") for entry in entries} | {
            model_id for model_id, owner in backend.book.owners.items() if owner == user}
        runs = [run_of(run_id, user, entries) for run_id in ids if run_id]
        if access_scope == "accessible":
            shared: dict[tuple[str, str], list[tuple[dict, Path, str, str]]] = {}
            for entry in saved_checkpoints(backend.weights_dir):
                facts, _, kind, name = entry
                path = f"tinker://{facts.get('model_id')}/{kind}/{name}"
                if facts.get("user") != user and backend.ledger.public(path):
                    shared.setdefault((facts["model_id"], facts["user"]), []).append(entry)
            runs += [run_of(run_id, owner, published) for (run_id, owner), published in shared.items()]
        runs.sort(key=lambda run: (run.last_request_time, run.training_run_id), reverse=True)
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
        return types.TrainingRunsResponse(training_runs=runs[offset:offset + limit], cursor=cursor
                                          ).model_dump(mode="json")
