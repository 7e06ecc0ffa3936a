"""The errors of reaching storage, each a `StorageError` (an OSError) whose message names the URI and what to do.

`StorageUnreachable`: the endpoint did not answer (transient: a job's start is retried); `CorruptCheckpoint`: an
uploaded checkpoint does not match its pointer."""

from __future__ import annotations


class StorageError(OSError):
    """A storage URI could not be read or written; the message names the URI and what to do. `fix`: what a user
    fixes, in a few words ("the URI", "the storage credentials"), where the cause is known."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


class StorageUnreachable(StorageError):
    """The storage endpoint did not answer (network, a busy or restarting server): worth trying again later."""


class CorruptCheckpoint(StorageError):
    """An uploaded checkpoint whose objects do not match its pointer (size or sha256)."""
