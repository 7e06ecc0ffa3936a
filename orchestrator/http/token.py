"""The HTTP API's bearer token: generated once (`secrets.token_urlsafe`), kept in a file only its owner may
read (mode 0600, in a folder of mode 0700; default `~/.aspen/http-token`, beside the service's default state
folder), read by `aspen http` (the server), `aspen http-token` (prints it) and the Ray-free client
(`$ASPEN_TOKEN` first, then the file). Ray-free and torch-free."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from actors.storage.durable import write_durably

DEFAULT_TOKEN_FILE = Path("~/.aspen/http-token")
TOKEN_ENV = "ASPEN_TOKEN"
TOKEN_FILE_ENV = "ASPEN_TOKEN_FILE"
TOKEN_BYTES = 32   # 256 bits of randomness, 43 URL-safe characters


class TokenFileError(PermissionError):
    """The token file cannot be used: missing, empty, or readable by others than its owner."""


def token_file(path: str | Path | None = None) -> Path:
    """The token file: `path`, else `$ASPEN_TOKEN_FILE`, else `~/.aspen/http-token`."""
    return Path(path or os.environ.get(TOKEN_FILE_ENV) or DEFAULT_TOKEN_FILE).expanduser()


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenFileError(f"{path} is readable by other users (mode {stat.filemode(mode)}); anyone who reads it "
                             f"can use the HTTP API: `chmod 600 {path}` (or delete it: a new token is generated)")


def read_token(path: str | Path | None = None) -> str:
    """The token kept in the file (TokenFileError if it is missing, empty or not private)."""
    path = token_file(path)
    if not path.is_file():
        raise TokenFileError(f"no HTTP API token in {path}: start the API (`aspen http`) or run `aspen http-token` "
                             f"on the service's machine, or set ${TOKEN_ENV}")
    _check_private(path)
    token = path.read_text().strip()
    if not token:
        raise TokenFileError(f"{path} is empty; delete it and run `aspen http-token` to generate a token")
    return token


def ensure_token(path: str | Path | None = None, *, rotate: bool = False) -> str:
    """The token in the file, generating it first (mode 0600, created atomically) where there is none or
    `rotate` is set."""
    path = token_file(path)
    if path.exists() and not rotate:
        return read_token(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    write_durably(path, token + "\n", private=True)
    return token


def client_token(path: str | Path | None = None) -> str:
    """What a client sends: `$ASPEN_TOKEN`, else the token file's."""
    return os.environ.get(TOKEN_ENV) or read_token(path)
