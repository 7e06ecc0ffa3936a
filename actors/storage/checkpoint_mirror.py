"""Complete checkpoints mirrored to a storage URI and read back, never half-written (as Ray Train's
`storage_path`).

A trainer writes checkpoints atomically to a NODE-LOCAL staging folder (actors/checkpoint/, unchanged), then
`upload_checkpoint` mirrors that complete folder to `<uri>/checkpoints/<step>-<token>/` and only then writes
the pointer `<uri>/checkpoint.json` (one object, written last) naming that upload with every file's size and
sha256. A reader (`download_checkpoint`, on any node) follows the pointer (`read_pointer`), so it never sees a
half-written upload: a crash between the files and the pointer leaves the previous pointer, and the previous
upload, in place. Older uploads are deleted after the pointer moved. Downloaded files are checked against the
pointer's sizes and hashes; a mismatch is a `CorruptCheckpoint` naming the object."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.storage.durable import staging_folder
from actors.storage.storage_errors import CorruptCheckpoint, StorageError
from actors.storage.storage_location import StorageLocation, _NotFound

POINTER_NAME = "checkpoint.json"
UPLOADS_FOLDER = "checkpoints"
POINTER_FORMAT = 1


def upload_checkpoint(location: StorageLocation, folder: str | Path, step: int,
                      go_on: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Mirror the complete local checkpoint `folder` to a fresh `checkpoints/<step>-<token>/` under
    `location`, then point `checkpoint.json` at it (written last), then delete older uploads. A failure
    before the pointer leaves the previous pointer and its upload untouched. Returns the new pointer.
    `go_on`: asked before the pointer is written; False (its uploader gave up waiting for it, e.g. the job
    resumes elsewhere meanwhile) leaves the pointer as it was and raises StorageError."""
    folder = Path(folder)
    upload = f"{UPLOADS_FOLDER}/{step:09d}-{uuid.uuid4().hex[:8]}"
    files = location.upload_folder(folder, upload)
    if not files:
        raise StorageError(f"{folder}: no checkpoint files to upload to {location.uri}")
    if go_on is not None and not go_on():
        location.delete(upload)
        raise StorageError(f"{location.uri}: the upload of the checkpoint at step {step} was abandoned before its "
                           "pointer (its trainer stopped waiting for it); the previous checkpoint stays the latest")
    pointer = {"format": POINTER_FORMAT, "step": int(step), "upload": upload, "files": files,
               "time": round(time.time(), 3)}
    location.write_bytes(POINTER_NAME, (json.dumps(pointer, indent=1) + "\n").encode())
    for old in location.list(UPLOADS_FOLDER):
        if f"{UPLOADS_FOLDER}/{old}" != upload:
            try:
                location.delete(f"{UPLOADS_FOLDER}/{old}")
            except StorageError:   # the new checkpoint is complete; the next upload deletes it again
                pass
    return pointer


def read_pointer(location: StorageLocation) -> dict[str, Any] | None:
    """The pointer to the latest complete upload, or None when nothing was uploaded yet. A pointer that
    does not parse is a CorruptCheckpoint."""
    try:
        raw = location.read_bytes(POINTER_NAME)
    except _NotFound:
        return None
    where = f"{location.uri}/{POINTER_NAME}"
    try:
        pointer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpoint(f"{where}: not a checkpoint pointer ({error}); delete it (the job then starts "
                                "over) or put back a valid one") from error
    ok = (isinstance(pointer, dict) and pointer.get("format") == POINTER_FORMAT
          and isinstance(pointer.get("step"), int) and isinstance(pointer.get("upload"), str)
          and isinstance(pointer.get("files"), dict) and pointer["files"]
          and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                  for v in pointer["files"].values()))
    if not ok:
        raise CorruptCheckpoint(f"{where}: not a format-{POINTER_FORMAT} checkpoint pointer (step, upload, files "
                                "with bytes and sha256); delete it (the job then starts over) or put back a valid one")
    return pointer


def download_checkpoint(location: StorageLocation, folder: str | Path) -> int | None:
    """Download the latest complete upload into `folder` (what was there is replaced, only once every
    object arrived and matched its size and sha256). Returns its step, or None when there is no pointer.
    Raises CorruptCheckpoint (`folder` untouched) when an object is missing or does not match."""
    pointer = read_pointer(location)
    if pointer is None:
        return None
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(folder.parent, f".{folder.name}.download-")
    try:
        for name, expected in pointer["files"].items():
            where = f"{location.uri}/{pointer['upload']}/{name}"
            if name.startswith("/") or ".." in Path(name).parts:
                raise CorruptCheckpoint(f"{location.uri}/{POINTER_NAME}: file name {name!r} leaves the checkpoint")
            try:
                data = location.read_bytes(f"{pointer['upload']}/{name}")
            except _NotFound as error:
                raise CorruptCheckpoint(f"{where}: missing, although {location.uri}/{POINTER_NAME} names it; the "
                                        "upload was damaged: delete the pointer (the job starts over) or restore "
                                        "the object") from error
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != expected["bytes"] or digest != expected["sha256"]:
                raise CorruptCheckpoint(f"{where}: {len(data)} bytes with sha256 {digest[:16]}..., the pointer says "
                                        f"{expected['bytes']} bytes with sha256 {expected['sha256'][:16]}...; the "
                                        "object was damaged or replaced: delete the pointer (the job starts over) "
                                        "or restore the object")
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return pointer["step"]
