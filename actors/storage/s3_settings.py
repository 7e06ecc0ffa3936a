"""The S3 settings a service's configuration gives (`storage:` of actors/service/scheduler/config.py), used before
the environment's.

The service hands its `S3Settings` to every process it starts, which calls `configure_storage`
(`storage_configured` for a scope); a configured endpoint or region wins over the environment's. Credentials are
never configured values: `access_key_env` / `secret_key_env` / `session_token_env` name the environment variables
each process reads them from (without them: the AWS SDK's own chain)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit


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
