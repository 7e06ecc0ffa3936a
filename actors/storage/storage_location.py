"""One folder-like place under a storage URI, reached through `pyarrow.fs`: objects read, written, listed and deleted.

A storage URI: `s3://bucket/prefix`, `gs://bucket/prefix`, `file:///mnt/shared/x`, ...; `StorageLocation(uri)`
with `.child(name)`, `.read_bytes(name)`, `.write_bytes(name, data)`, `.exists(name)`, `.list(name)`,
`.modified_at(name)`, `.delete()`, `.upload_file(local, name)`, `.download_file(name, local)`,
`.upload_folder(local, name)`, `.check_writable()`; `read_uri_bytes(uri)`, one object (a job's dataset). Ray-free
and torch-free; a failure is a StorageError (actors/storage/storage_errors.py) naming the URI and the fix.

S3 settings come from the standard environment: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(/ AWS_SESSION_TOKEN, ~/.aws, instance roles, as the AWS SDK finds them), the region from AWS_REGION /
AWS_DEFAULT_REGION, and an S3-compatible endpoint (MinIO, Ceph, moto) from AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL (`http://host:9000`), which pyarrow itself does not read. Every process that touches the
URI (the trainers and the job actors on every node) needs them. A service's configuration may give them
instead (actors/storage/s3_settings.py)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from actors.storage.durable import write_durably
from actors.storage.s3_settings import configured_storage, endpoint_problem
from actors.storage.storage_errors import StorageError, StorageUnreachable

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0   # a request that transfers nothing this long fails (the AWS SDK's default, 3 s, fails
                           # requests to a busy store: it is curl's low-speed time on Linux)
S3_ATTEMPTS = 3
WRITE_PROBE = ".aspen-write-check-"   # the small object `check_writable` writes and deletes


def _s3_settings() -> dict[str, Any]:
    """S3FileSystem arguments: the configured settings (`configure_storage`), else the environment's: the
    endpoint of an S3-compatible store (pyarrow reads AWS_ACCESS_KEY_ID etc. itself, but not
    AWS_ENDPOINT_URL[_S3]), the region, and credentials from the environment variables the settings name."""
    import pyarrow.fs as pafs

    settings: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
                                "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS)}
    configured = configured_storage()
    if configured.endpoint_url:
        problem = endpoint_problem(configured.endpoint_url)
        if problem:
            raise StorageError(f"storage.endpoint_url of the service's configuration: {problem}",
                               "storage.endpoint_url of the service's configuration")
        parts = urlsplit(configured.endpoint_url)
        settings["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        settings["scheme"] = parts.scheme
    elif endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if not parts.netloc:
            raise StorageError(f"AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL is {endpoint!r}, not an endpoint URL; set it "
                               "to e.g. http://minio.local:9000", "AWS_ENDPOINT_URL_S3")
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


CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
READING = ("looking it up", "reading", "opening", "listing")


def _credentials_seen() -> bool:
    """Whether this process has S3 credentials the AWS SDK's chain finds without asking the network: the
    service's configured variables, the environment's, a profile or the ~/.aws files (an instance role's
    cannot be seen without asking)."""
    configured = configured_storage()
    if configured.access_key_env or configured.secret_key_env or any(os.environ.get(name)
                                                                      for name in CREDENTIAL_VARIABLES):
        return True
    files = (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
             os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    return any(Path(name).expanduser().is_file() for name in files)


def _denied_hint(doing: str) -> str:
    """What to do about an access denied while `doing`: without credentials the request went unsigned, and
    the fix is to give some; with them, to give them the access `doing` needs."""
    if not _credentials_seen():
        return ("access denied, and this process has no S3 credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "unset, no AWS_PROFILE, no ~/.aws/credentials), so the request went without them: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, or the variables storage.access_key_env "
                "/ secret_key_env of the service's configuration name) in every aspen process's environment")
    access = "read access to it" if doing in READING else "read and write access to this prefix"
    return f"permission denied: give these credentials {access}"


def _endpoint_at(uri: str) -> str:
    """' at <the endpoint an s3:// URI was asked at>' (and which setting named it); '' for other schemes."""
    if urlsplit(uri).scheme not in ("s3", "s3a"):
        return ""
    if configured_storage().endpoint_url:
        return f" at {configured_storage().endpoint_url} (storage.endpoint_url)"
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return f" at {os.environ[name]} ({name})"
    return " (AWS S3's own endpoint: no storage.endpoint_url or AWS_ENDPOINT_URL_S3 set)"


def _explain(uri: str, doing: str, error: BaseException) -> StorageError:
    """A StorageError for a failed `doing` on `uri`, with the fix the error's text points at."""
    text = str(error)
    upper = text.upper()
    if isinstance(error, StorageError):
        return error
    if "NETWORK_CONNECTION" in upper or "COULD NOT CONNECT" in upper or "RESOLVE HOST" in upper:
        return StorageUnreachable(f"{uri}: {doing} failed: the storage endpoint cannot be reached{_endpoint_at(uri)}: "
                                  "check that the store is up and the network reaches it, and that this is its "
                                  "endpoint (an S3-compatible store's: storage.endpoint_url in the service's "
                                  "configuration or AWS_ENDPOINT_URL_S3, e.g. http://host:9000, in every aspen "
                                  f"process's environment) ({type(error).__name__}: {text})")
    elif "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper:
        hint, fix = "the bucket does not exist: create it (or fix the bucket name in the URI)", "the URI's bucket"
    elif ("ACCESS_DENIED" in upper or "ACCESSDENIED" in upper or "FORBIDDEN" in upper or " 403" in text
          or isinstance(error, PermissionError)):
        hint, fix = _denied_hint(doing), "the storage credentials (or their access to the URI)"
    elif ("CREDENTIAL" in upper or "INVALID_ACCESS_KEY" in upper or "SIGNATURE" in upper
          or "UNRECOGNIZEDCLIENT" in upper):
        hint, fix = ("no valid credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile / instance "
                "role, or the variables storage.access_key_env / secret_key_env of the service's configuration name) "
                "in every aspen process's environment"), "the storage credentials"
    elif isinstance(error, FileNotFoundError):
        hint, fix = "it does not exist: check the URI (and that the bucket exists)", "the URI"
    else:
        hint, fix = "check the URI, the credentials and the endpoint", "the URI, the credentials or the endpoint"
    return StorageError(f"{uri}: {doing} failed: {hint} ({type(error).__name__}: {text})", fix)


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

    def modified_at(self, name: str = "") -> float | None:
        """When `name` was last written (seconds since the epoch), None where the store does not say."""
        try:
            when = self.fs.get_file_info(self._full(name)).mtime
        except OSError as error:
            raise _explain(self._uri(name), "looking it up", error) from error
        return None if when is None else when.timestamp()

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
        probe = f"{WRITE_PROBE}{uuid.uuid4().hex[:8]}"
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
