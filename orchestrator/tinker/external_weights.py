"""The Tinker API's external weights: `save_weights_external` writes a model's weights in Hugging Face's format (the
base with the adapter merged: config.json, model.safetensors and the tokenizer's files, what `AutoModelForCausalLM.
from_pretrained` and vLLM load) as `tinker://<model>/external_weights/<name>`, and `get_external_weights_urls`
answers a signed download URL per file, which this server serves without a key until it expires (an hour), so a
user reaches their weights with the SDK alone, from any machine.

The adapter is saved first, in the model's order of calls (a staging folder beside the checkpoint), then merged in a
thread of its own, from the base's own files, as `aspen export --merge` does (actors/checkpoint/adapter_export.py):
no trainer waits for the merge. The URLs are signed with a key kept in the weights folder (so they outlive a restart
until they expire); a URL changed in any part, or expired, is refused. age encryption is not served."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse
from tinker import types

from actors.checkpoint.peft_io import METADATA_NAME
from actors.service.trainer.interactive_commands import SaveSampler
from actors.storage.durable import write_durably
from orchestrator.tinker.answers import typed
from orchestrator.tinker.checkpoint_ledger import ttl_problem

KIND = "external_weights"
URLS_VALID_S = 3600
KEY_FILE = ".external_weights_url_key"
log = logging.getLogger(__name__)


def url_key(weights_dir: Path) -> bytes:
    """The key the download URLs are signed with: made once, kept in the weights folder (readable by its owner)."""
    path = weights_dir / KEY_FILE
    if not path.exists():
        weights_dir.mkdir(parents=True, exist_ok=True)
        write_durably(path, secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip().encode()


def sign(key: bytes, model_id: str, name: str, file: str, expires: int) -> str:
    return hmac.new(key, f"{model_id}\n{name}\n{file}\n{expires}".encode(), hashlib.sha256).hexdigest()


def files_of(folder: Path) -> list[str]:
    """The checkpoint's files, relative to it (aspen's own record of it left out)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.is_file() and path.name != METADATA_NAME)


def merge_saved(adapter_dir: Path, folder: Path, facts: dict[str, Any]) -> int:
    """The saved adapter merged into its base at `folder` (with aspen's record of the checkpoint, `facts`); the
    adapter's staging folder removed. Returns the checkpoint's size in bytes."""
    from actors.checkpoint.adapter_export import export_merged

    try:
        export_merged(adapter_dir, folder)
    finally:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    write_durably(folder / METADATA_NAME, json.dumps(facts, indent=2) + "\n")
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def add_external_routes(router: APIRouter, ctx: Any, user_of: Callable[..., str],
                        readable: Callable[[str, str], Path]) -> None:
    """The routes; `readable(path, user)`: a checkpoint's folder the user may read (theirs or published), else 404."""
    backend = ctx.backend

    @router.post("/save_weights_external")
    def save_weights_external(body: types.SaveWeightsExternalRequest, user: str = Depends(user_of)) -> dict:
        model_id = ctx.owned(body.model_id, user)
        name = body.path
        if not name or "/" in name or name.startswith("."):
            raise HTTPException(422, f"path '{name}' must be a plain name (no '/', not starting with '.')")
        if body.age_encryption_recipients:
            raise HTTPException(422, "age_encryption_recipients: aspen does not encrypt external weights; save "
                                     "without, and fetch them over HTTPS (`aspen http --ssl-certfile`)")
        if (problem := ttl_problem(body.ttl_seconds)) is not None:
            raise HTTPException(422, problem)
        folder = backend.folder(model_id) / KIND / name
        adapter_dir = folder.parent / f".{name}.adapter"
        if folder.exists() or adapter_dir.exists():
            raise HTTPException(422, f"tinker://{model_id}/{KIND}/{name} exists or is being written; save under "
                                     "another name")
        path = f"tinker://{model_id}/{KIND}/{name}"
        base = backend.book.model_bases[model_id]
        saved = ctx.calls.submit(model_id, body.seq_id or 0, "apply",
                                 SaveSampler(adapter_dir, base, model_id, user, path, None))
        done: Future = Future()

        def merge() -> None:
            try:
                facts = json.loads((adapter_dir / METADATA_NAME).read_text())
                size = merge_saved(adapter_dir, folder, facts)
            except Exception as error:  # noqa: BLE001 - the call's answer: why its weights were not written
                log.warning("tinker: %s could not be written: %s", path, error)
                done.set_exception(ValueError(f"{path}: merging the adapter into its base failed: {error}"))
                return
            backend.ledger.record(path, body.ttl_seconds, None, user)
            done.set_result(size)

        def saved_then(future: Future) -> None:
            if future.exception() is not None:
                done.set_exception(future.exception())
            else:   # on its own thread: the trainer's stepping thread runs this callback
                threading.Thread(target=merge, name=f"tinker-external-{name}", daemon=True).start()

        saved.add_done_callback(saved_then)
        return ctx.future(done, user, lambda size: typed(types.SaveWeightsExternalResponseInternal,
                                                         "save_weights_external", path=path, size_bytes=size),
                          model_id)

    @router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    def external_weights_urls(run_id: str, checkpoint_id: str, request: Request,
                              user: str = Depends(user_of)) -> dict:
        path = f"tinker://{run_id}/{checkpoint_id}"
        if not checkpoint_id.startswith(f"{KIND}/"):
            raise HTTPException(404, f"{path} is not an external weights checkpoint (tinker://<model>/{KIND}/<name>)")
        folder = readable(path, user)
        name = checkpoint_id.removeprefix(f"{KIND}/")
        expires = int(time.time()) + URLS_VALID_S
        key = url_key(backend.weights_dir)
        root = str(request.base_url).rstrip("/")
        urls = {file: (f"{root}/api/v1/{KIND}/{quote(run_id, safe='')}/{quote(name, safe='')}/{quote(file)}"
                       f"?expires={expires}&signature={sign(key, run_id, name, file, expires)}")
                for file in files_of(folder)}
        return types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC)
                                                 ).model_dump(mode="json")

    @router.get(f"/{KIND}/{{run_id}}/{{name}}/{{file:path}}")
    def download(run_id: str, name: str, file: str, expires: int, signature: str) -> FileResponse:
        """A file of an external weights checkpoint, for a URL `external_weights_urls` signed (no key needed)."""
        expected = sign(url_key(backend.weights_dir), run_id, name, file, expires)
        if not hmac.compare_digest(signature, expected):
            raise HTTPException(403, "this download URL is not one aspen signed (changed, or from another server); "
                                     "ask get_external_weights_urls for new ones")
        if expires < time.time():
            raise HTTPException(403, "this download URL has expired; ask get_external_weights_urls for new ones")
        folder = (backend.folder(run_id) / KIND / name).resolve()
        target = (folder / file).resolve()
        if folder not in target.parents or not target.is_file():
            raise HTTPException(404, f"no file {file} in tinker://{run_id}/{KIND}/{name} (deleted, or expired)")
        return FileResponse(target, filename=target.name)
