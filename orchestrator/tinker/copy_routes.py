"""The Tinker SDK's `copy_weights` (RestClient's and ServiceClient's) and its checkpoint storage usage
(`AdminClient.get_current_checkpoint_storage_usage`, the RestClient's deprecated call of it) on aspen.

A copy is a checkpoint the user may read (their own, or a published one) copied, its kind kept, into a new training
run of theirs (`tinker://copy-<hex>/<kind>/<name>`) that no model trains: its files hard-linked to the source's where
both lie on one file system (Tinker shares the storage; so does this: the copy costs no second copy of the weights),
else copied (`link_or_copy`). Linking is safe because nothing writes into a saved file again: every save writes
each file anew and renames it into place (actors/storage/durable.py's write_durably, save_adapter), so a save again
under the source's path gives it new files and leaves the copy's as they were; a deletion unlinks the source's names
only. The copy's facts files are rewritten the same way (new files, naming the copy's run and user). Its source's
`user_metadata` kept, its `ttl_seconds` its own (the source's expiry is not inherited), its run file naming the
source (`copied_from`). aspen has no projects: the destination project the SDK insists on (or its session) is taken
as the user themself (the SDK asks it before sending: aspen cannot supply a default). The SDK's idempotency key
(the user's: two users' same key are two copies) makes a retried copy answer the first one's path, also after a
restart (copy_keys.py: its run file records the key; kept a day, bounded). The
storage usage is the user's own checkpoints, as `list_user_checkpoints` lists them: one row, their count and the
bytes the disk holds for them (`disk_bytes`: a file linked into several of the user's checkpoints, a copy's and its
source's, counted once, as `du` counts it; each checkpoint's own `size_bytes` stays the size of its files)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, HTTPException
from tinker import types

from actors.checkpoint.interactive_state import STATE_FILE
from actors.checkpoint.peft_names import METADATA_NAME
from actors.storage.durable import fsync_tree, replace_durably, staging_folder, write_durably
from orchestrator.tinker import checkpoint_ledger
from orchestrator.tinker.checkpoint_ledger import ttl_problem
from orchestrator.tinker.copy_keys import CopyKeys

COPIED_KINDS = ("weights", "sampler_weights")


def add_copy_routes(router: APIRouter, ctx: Any, user_of: Callable[..., str],
                    readable: Callable[[str, str], tuple[dict, Path]],
                    own_folders: Callable[[str], list[Path]],
                    keep_run: Callable[..., None]) -> None:
    """`readable`: (facts, folder) of a checkpoint the user may read, else 404; `own_folders`: the folders of the
    user's checkpoints, as list_user_checkpoints lists them; `keep_run`: rest_routes.keep_run_metadata."""
    backend = ctx.backend
    copied = CopyKeys(lambda: backend.weights_dir)   # (user, idempotency key) -> the copy's path; the folder
    # asked of the service at the first copy, not here: `aspen http` starts (and answers 503) without a service
    lock = threading.Lock()

    @router.post("/copy_weights")
    def copy_weights(body: types.CopyWeightsRequest, user: str = Depends(user_of),
                     idempotency_key: str | None = Header(None, alias="X-Idempotency-Key"),
                     access_token: str | None = Header(None, alias="X-Tinker-Weights-Access-Token")) -> dict:
        if body.weights_access_token is not None or access_token is not None:
            raise HTTPException(422, "weights_access_token: aspen has no weights access tokens; the checkpoint's "
                                     "owner publishes it (publish_checkpoint_from_tinker_path), then copy it without")
        if (problem := ttl_problem(body.ttl_seconds)) is not None:
            raise HTTPException(422, problem)
        kind = body.source_path.removeprefix("tinker://").split("/")[1:2]
        if kind and kind[0] not in COPIED_KINDS:
            raise HTTPException(422, f"{body.source_path}: a saved state (weights/) or sampler weights "
                                     "(sampler_weights/) are copied; save_weights_external's are not")
        with lock:
            if idempotency_key is not None and (first := copied.find(user, idempotency_key)) is not None:
                return types.CopyWeightsResponse(tinker_path=first).model_dump(mode="json")
            facts, source = readable(body.source_path, user)
            run_id = f"copy-{secrets.token_hex(6)}"
            path = copy_checkpoint(backend, source, run_id, user)
            made_at = checkpoint_ledger.now()
            keyed = {"idempotency_key": idempotency_key, "copied_at": made_at, "tinker_path": path}
            keep_run(backend.folder(run_id), user, None,
                     origin={"copied_from": body.source_path} | (keyed if idempotency_key is not None else {}))
            if idempotency_key is not None:
                copied.add(user, idempotency_key, path, made_at)
        backend.ledger.record(path, body.ttl_seconds, backend.ledger.user_metadata(body.source_path), user)
        return types.CopyWeightsResponse(tinker_path=path).model_dump(mode="json")

    @router.get("/billing/usage/checkpoints/current")
    def storage_usage(project_id: str | None = None, user: str = Depends(user_of)) -> dict:
        if project_id is not None:
            raise HTTPException(422, f"project_id '{project_id}': aspen has no projects; ask without one (your "
                                     "own checkpoints' usage)")
        found = own_folders(user)
        size = disk_bytes(found)
        row = types.CurrentCheckpointStorageUsageItem(user_name=user, checkpoint_count=len(found), size_bytes=size,
                                                      size_gigabytes=size / 1e9)
        return types.CurrentCheckpointStorageUsageResponse(data=[row]).model_dump(mode="json")


def disk_bytes(folders: list[Path]) -> int:
    """The bytes the disk holds for the files under `folders`: each file (device and inode) counted once, however
    many of the folders link it (a copy's files are its source's: copy_checkpoint), as `du` counts them."""
    sizes: dict[tuple[int, int], int] = {}
    for folder in folders:
        for path in folder.rglob("*"):
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue   # deleted meanwhile (its checkpoint's deletion, expiry)
            if stat.S_ISREG(info.st_mode):
                sizes[(info.st_dev, info.st_ino)] = info.st_size
    return sum(sizes.values())


def copy_checkpoint(backend: Any, source: Path, run_id: str, user: str) -> str:
    """`source` (a checkpoint's folder: <run>/<kind>/<name>) copied into run `run_id` of `user`; its path. Built in
    a hidden staging folder (listings skip those), its facts then naming the copy's run and user, and put in place
    durably."""
    kind, name = source.parent.name, source.name
    target = backend.folder(run_id) / kind / name
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(target.parent, f".{name}-")
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True, copy_function=link_or_copy)
        for facts_name in (STATE_FILE, METADATA_NAME):
            facts_file = staging / facts_name
            if facts_file.is_file():
                facts = json.loads(facts_file.read_text())
                write_durably(facts_file, json.dumps(facts | {"model_id": run_id, "user": user}, indent=2))
        fsync_tree(staging)
        replace_durably(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return f"tinker://{run_id}/{kind}/{name}"


def link_or_copy(source: str, target: str) -> str:
    """`target` as a hard link to `source` (no second copy of its bytes), or a copy of it where the file system
    refuses links (another file system, one without hard links, a file at its link limit, a link the user may not
    make). Safe only for files nothing writes into after their save (the module's docstring says why aspen's are)."""
    try:
        os.link(source, target)
    except OSError:   # EXDEV, EPERM, EMLINK, ENOTSUP...: a source that cannot be read fails the copy below too
        shutil.copy2(source, target)
    return target
