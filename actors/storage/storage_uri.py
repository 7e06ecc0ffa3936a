"""Storage URIs told apart from plain paths and kept intact.

`is_uri` ("scheme://...", a Path never is), `StorageURI` (a URI that joins with `/` like a Path), and
`as_location` / `resolve_location`, what spec fields hold.

Plain paths stay plain paths: nothing in actors/storage is used for them (`is_uri` is False), so a job whose
output is a local folder (or a mounted shared one) behaves as it always did."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


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
