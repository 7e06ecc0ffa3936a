"""Where a job's results live when they are not on a disk every process shares: a storage URI
(`s3://bucket/prefix`, `gs://bucket/prefix`, `file:///mnt/shared/x`, ...) reached through `pyarrow.fs`, and
the mirroring of complete checkpoints to it. Ray-free and torch-free.

Plain paths stay plain paths: nothing here is used for them (`is_uri` is False), so a job whose output is a
local folder (or a mounted shared one) behaves as it always did.

The model (as Ray Train's `storage_path`): a trainer writes checkpoints atomically to a NODE-LOCAL staging
folder (actors/checkpoint/, unchanged), then `upload_checkpoint` mirrors that complete folder to
`<uri>/checkpoints/<step>-<token>/` and only then writes the pointer `<uri>/checkpoint.json` (one object,
written last) naming that upload with every file's size and sha256. A reader (`download_checkpoint`, on any
node) follows the pointer, so it never sees a half-written upload: a crash between the files and the pointer
leaves the previous pointer, and the previous upload, in place. Older uploads are deleted after the pointer
moved. Downloaded files are checked against the pointer's sizes and hashes; a mismatch is a
`CorruptCheckpoint` naming the object.

API (small on purpose):
    is_uri(location) -> bool                     "scheme://..." (a Path never is)
    StorageURI(str)                              a URI that joins with `/` like a Path: `uri / "job-1"`
    as_location(value) -> Path | StorageURI      what spec fields hold (a URI kept intact, a path as a Path)
    resolve_location(value)                      the same, a path made absolute
    StorageLocation(uri)                         one folder-like place: `.child(name)`, `.read_bytes(name)`,
                                                 `.write_bytes(name, data)`, `.exists(name)`, `.delete()`,
                                                 `.upload_file(local, name)`, `.download_file(name, local)`,
                                                 `.upload_folder(local, name)`, `.check_writable()`
    upload_checkpoint(location, folder, step)    mirror a complete local checkpoint; returns the pointer
    read_pointer(location) -> dict | None        the pointer of the latest complete upload
    download_checkpoint(location, folder)        the latest complete upload into `folder` (replaced);
                                                 returns its step, or None when there is none
    read_uri_bytes(uri) -> bytes                 one object (a job's dataset)
    StorageError(OSError), CorruptCheckpoint(StorageError): messages name the URI and what to do;
    StorageUnreachable(StorageError): the endpoint did not answer (transient: a job's start is retried)

S3 settings come from the standard environment: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(/ AWS_SESSION_TOKEN, ~/.aws, instance roles, as the AWS SDK finds them), the region from AWS_REGION /
AWS_DEFAULT_REGION, and an S3-compatible endpoint (MinIO, Ceph, moto) from AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL (`http://host:9000`), which pyarrow itself does not read. Every process that touches the
URI (the trainers and the job actors on every node) needs them.

A service's configuration may give them instead (`storage:` of actors/service/scheduler/config.py): the service hands
its `S3Settings` to every process it starts, which calls `configure_storage` (`storage_configured` for a
scope); a configured endpoint or region wins over the environment's. Credentials are never configured
values: `access_key_env` / `secret_key_env` / `session_token_env` name the environment variables each
process reads them from (without them: the AWS SDK's own chain, as above)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from actors.storage.durable import staging_folder, write_durably

POINTER_NAME = "checkpoint.json"
UPLOADS_FOLDER = "checkpoints"
POINTER_FORMAT = 1
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0   # a request that transfers nothing this long fails (the AWS SDK's default, 3 s, fails
                           # requests to a busy store: it is curl's low-speed time on Linux)
S3_ATTEMPTS = 3


class StorageError(OSError):
    """A storage URI could not be read or written; the message names the URI and what to do."""


class StorageUnreachable(StorageError):
    """The storage endpoint did not answer (network, a busy or restarting server): worth trying again later."""


class CorruptCheckpoint(StorageError):
    """An uploaded checkpoint whose objects do not match its pointer (size or sha256)."""


def is_uri(location: object) -> bool:
    """True for "scheme://..." strings (s3, gs, file, hdfs, ...); a Path or a plain path never is."""
    return isinstance(location, str) and "://" in location and urlsplit(location).scheme != ""


class StorageURI(str):
    """A storage URI that joins like a Path (`uri / "job-1"` -> `s3://bucket/prefix/job-1`); `.name` is
    its last part."""

    def __truediv__(self, other: str | os.PathLike[str]) -> StorageURI:
        return StorageURI(self.rstrip("/") + "/" + str(other).strip("/"))

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def is_relative_to(self, root: str) -> bool:
        root = str(root).rstrip("/")
        return self.rstrip("/") == root or self.startswith(root + "/")


_MANGLED_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/([^/].*)$")


def as_location(value: Any) -> Path | StorageURI:
    """A URI string as a `StorageURI` (kept intact: `Path("s3://b/x")` would lose a slash), anything else as
    a `Path`. A URI already passed through `Path` (`s3:/b/x`) is given its slash back."""
    if isinstance(value, StorageURI):
        return value
    if isinstance(value, str) and is_uri(value):
        return StorageURI(value.rstrip("/"))
    mangled = _MANGLED_URI.match(str(value))
    if isinstance(value, Path) and mangled:
        return StorageURI(f"{mangled.group(1)}://{mangled.group(2)}".rstrip("/"))
    return Path(value)


def resolve_location(value: str | os.PathLike[str]) -> Path | StorageURI:
    """A location as a service compares and stores it: a URI as it is, a path expanded and made absolute."""
    location = as_location(value)
    return location if isinstance(location, StorageURI) else location.expanduser().resolve()


@dataclass(frozen=True)
class S3Settings:
    """S3 settings a service's configuration gives (`storage:`), used before the environment's. The `*_env`
    fields name environment variables (the credentials themselves are never settings)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_env: str | None = None
    secret_key_env: str | None = None
    session_token_env: str | None = None


_configured = S3Settings()


def configure_storage(settings: S3Settings | None) -> None:
    """Use `settings` for every storage URI this process opens from now on (None: the environment's only)."""
    global _configured
    _configured = settings or S3Settings()


def configured_storage() -> S3Settings:
    return _configured


@contextmanager
def storage_configured(settings: S3Settings | None) -> Iterator[None]:
    """`configure_storage(settings)` for the block; what was configured before is put back after it."""
    before = _configured
    configure_storage(settings)
    try:
        yield
    finally:
        configure_storage(before)


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not an S3 endpoint URL (http[s]://host[:port][/path]), or None."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{endpoint!r} is not an endpoint URL: write http://host:port or https://host (e.g. http://minio.local:9000)"
    if parts.username or parts.password or parts.query or parts.fragment:
        return (f"{endpoint!r}: an endpoint URL holds no credentials, query or fragment: give http[s]://host:port and "
                "the credentials in environment variables (access_key_env / secret_key_env name them)")
    try:
        _ = parts.port   # urllib checks the port only when it is read
    except ValueError:
        return f"{endpoint!r}: its port is not a number from 0 to 65535"
    return None


def _s3_settings() -> dict[str, Any]:
    """S3FileSystem arguments: the configured settings (`configure_storage`), else the environment's: the
    endpoint of an S3-compatible store (pyarrow reads AWS_ACCESS_KEY_ID etc. itself, but not
    AWS_ENDPOINT_URL[_S3]), the region, and credentials from the environment variables the settings name."""
    import pyarrow.fs as pafs

    settings: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
                                "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS)}
    configured = _configured
    if configured.endpoint_url:
        problem = endpoint_problem(configured.endpoint_url)
        if problem:
            raise StorageError(f"storage.endpoint_url of the service's configuration: {problem}")
        parts = urlsplit(configured.endpoint_url)
        settings["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        settings["scheme"] = parts.scheme
    elif endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if not parts.netloc:
            raise StorageError(f"AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL is {endpoint!r}, not an endpoint URL; set it "
                               "to e.g. http://minio.local:9000")
        settings["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        settings["scheme"] = parts.scheme
    region = configured.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        settings["region"] = region
    if configured.access_key_env or configured.secret_key_env:
        settings["access_key"] = _named_variable("access_key_env", configured.access_key_env)
        settings["secret_key"] = _named_variable("secret_key_env", configured.secret_key_env)
        if configured.session_token_env:
            settings["session_token"] = _named_variable("session_token_env", configured.session_token_env)
    return settings


def _named_variable(field: str, name: str | None) -> str:
    """The value of the environment variable that `storage.<field>` names; a StorageError saying where to set it."""
    value = os.environ.get(name) if name else None
    if not value:
        import socket

        raise StorageError(f"storage.{field} of the service's configuration names the environment variable {name!r}, "
                           f"which is not set in this aspen process on {socket.gethostname()}: set it in the "
                           "environment of every node's `ray start` (or of `aspen serve`), or drop the "
                           "storage.*_env settings to use the AWS SDK's own credentials (AWS_ACCESS_KEY_ID, "
                           "~/.aws, instance roles)")
    return value


def _filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for `uri`."""
    import pyarrow.fs as pafs

    parts = urlsplit(uri)
    try:
        if parts.scheme in ("s3", "s3a"):
            if not parts.netloc:
                raise StorageError(f"{uri}: no bucket; write s3://<bucket>/<prefix>")
            if parts.query:
                raise StorageError(f"{uri}: options in the URI (?{parts.query}) are not supported; set the endpoint "
                                   "in AWS_ENDPOINT_URL_S3 and the credentials in AWS_ACCESS_KEY_ID / "
                                   "AWS_SECRET_ACCESS_KEY")
            return pafs.S3FileSystem(**_s3_settings()), (parts.netloc + parts.path).rstrip("/")
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except StorageError:
        raise
    except (OSError, ValueError) as error:
        raise StorageError(f"{uri}: cannot open this storage URI: {error}; use s3://bucket/prefix, gs://bucket/"
                           "prefix, file:///absolute/path, or a plain path") from error
    return filesystem, path.rstrip("/")


def _explain(uri: str, doing: str, error: BaseException) -> StorageError:
    """A StorageError for a failed `doing` on `uri`, with the fix the error's text points at."""
    text = str(error)
    upper = text.upper()
    if isinstance(error, StorageError):
        return error
    if "NETWORK_CONNECTION" in upper or "COULD NOT CONNECT" in upper or "RESOLVE HOST" in upper:
        return StorageUnreachable(f"{uri}: {doing} failed: the storage endpoint cannot be reached: check the network, "
                                  "and for an S3-compatible store set storage.endpoint_url in the service's "
                                  "configuration "
                                  "or AWS_ENDPOINT_URL_S3 (e.g. http://host:9000) in every aspen process's environment "
                                  f"({type(error).__name__}: {text})")
    elif "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper:
        hint = "the bucket does not exist: create it (or fix the bucket name in the URI)"
    elif ("ACCESS_DENIED" in upper or "ACCESSDENIED" in upper or "FORBIDDEN" in upper or " 403" in text
          or isinstance(error, PermissionError)):
        hint = "permission denied: give these credentials read and write access to this prefix"
    elif ("CREDENTIAL" in upper or "INVALID_ACCESS_KEY" in upper or "SIGNATURE" in upper
          or "UNRECOGNIZEDCLIENT" in upper):
        hint = ("no valid credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile / instance "
                "role, or the variables storage.access_key_env / secret_key_env of the service's configuration name) "
                "in every aspen process's environment")
    elif isinstance(error, FileNotFoundError):
        hint = "it does not exist: check the URI (and that the bucket exists)"
    else:
        hint = "check the URI, the credentials and the endpoint"
    return StorageError(f"{uri}: {doing} failed: {hint} ({type(error).__name__}: {text})")


class StorageLocation:
    """One folder-like place under a storage URI. Names are '/'-separated, relative to it."""

    def __init__(self, uri: str, *, _fs: Any = None, _path: str | None = None):
        self.uri = str(uri).rstrip("/")
        if _fs is None:
            _fs, _path = _filesystem(self.uri)
        self.fs, self.path = _fs, _path or ""

    def __repr__(self) -> str:
        return f"StorageLocation({self.uri!r})"

    def child(self, name: str) -> StorageLocation:
        return StorageLocation(f"{self.uri}/{name.strip('/')}", _fs=self.fs, _path=self._full(name))

    def _full(self, name: str = "") -> str:
        name = name.strip("/")
        return f"{self.path}/{name}" if name else self.path

    def _uri(self, name: str = "") -> str:
        name = name.strip("/")
        return f"{self.uri}/{name}" if name else self.uri

    def exists(self, name: str = "") -> bool:
        import pyarrow.fs as pafs

        try:
            return self.fs.get_file_info(self._full(name)).type != pafs.FileType.NotFound
        except OSError as error:
            raise _explain(self._uri(name), "looking it up", error) from error

    def read_bytes(self, name: str = "") -> bytes:
        """The whole object; FileNotFoundError (a StorageError) when it is not there."""
        try:
            with self.fs.open_input_stream(self._full(name)) as stream:
                return stream.read()
        except FileNotFoundError as error:
            raise _NotFound(f"{self._uri(name)}: not found") from error
        except OSError as error:
            raise _explain(self._uri(name), "reading", error) from error

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write one object whole. On object stores a PUT is atomic; on a file system it is written to a
        temporary name and renamed (`durable.write_durably`), so that a reader never sees a part of it."""
        full = self._full(name)
        try:
            if _is_local(self.fs):
                write_durably(full, data)
            else:
                with self.fs.open_output_stream(full) as stream:
                    stream.write(data)
        except OSError as error:
            raise _explain(self._uri(name), "writing", error) from error

    def upload_file(self, local: str | Path, name: str) -> None:
        self.write_bytes(name, Path(local).read_bytes())

    def upload_folder(self, local: str | Path, name: str = "") -> dict[str, dict[str, Any]]:
        """Upload every file under `local` (recursively) to `name/...`; returns {relative name: {bytes,
        sha256}} of what was uploaded."""
        local = Path(local)
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            relative = path.relative_to(local).as_posix()
            data = path.read_bytes()
            self.write_bytes(f"{name}/{relative}" if name else relative, data)
            files[relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return files

    def download_file(self, name: str, local: str | Path) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(self.read_bytes(name))

    def list(self, name: str = "") -> list[str]:
        """The names directly under `name` (files and folders), [] when there is nothing."""
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self._full(name), allow_not_found=True))
        except OSError as error:
            raise _explain(self._uri(name), "listing", error) from error
        return sorted(info.base_name for info in infos)

    def delete(self, name: str = "") -> None:
        """Delete `name` (a file or everything under a folder); nothing there is fine."""
        import pyarrow.fs as pafs

        full = self._full(name)
        try:
            kind = self.fs.get_file_info(full).type
            if kind == pafs.FileType.Directory or (not _is_local(self.fs) and kind == pafs.FileType.NotFound):
                self.fs.delete_dir_contents(full, missing_dir_ok=True)
                if kind == pafs.FileType.Directory and full.count("/") > 0:
                    self.fs.delete_dir(full)
            elif kind == pafs.FileType.File:
                self.fs.delete_file(full)
        except FileNotFoundError:
            return
        except OSError as error:
            raise _explain(self._uri(name), "deleting", error) from error

    def check_writable(self) -> None:
        """Write and delete a small object: a StorageError naming the fix when the URI takes no writes (no
        bucket, no credentials, no permission, no endpoint)."""
        probe = f".aspen-write-check-{uuid.uuid4().hex[:8]}"
        self.write_bytes(probe, b"ok\n")
        self.delete(probe)


class _NotFound(StorageError, FileNotFoundError):
    """An object that is not there (both a StorageError and a FileNotFoundError)."""


def _is_local(filesystem: Any) -> bool:
    import pyarrow.fs as pafs

    return isinstance(filesystem, pafs.LocalFileSystem)


def read_uri_bytes(uri: str) -> bytes:
    """One object's bytes (e.g. a job's dataset); a StorageError naming the URI and the fix."""
    parts = urlsplit(uri)
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/") or not parts.path.strip("/"):
        raise StorageError(f"{uri}: names no object; give the URI of a file, e.g. s3://bucket/data/train.jsonl")
    return StorageLocation(parent).read_bytes(name)


# ---------------------------------------------------------------------------------------- checkpoints


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
