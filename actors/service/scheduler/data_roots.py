"""What a job may read: its data must lie under one of the service's data roots (paths, and storage URI
prefixes) or its user's own, and never in the service's state folder or another user's outputs.

Paths are compared as the file system resolves them (`..` and every symlink followed: a link inside a root
that points out of it is out), and a folder's every entry is checked, not only its name. A URI is compared
by its text, component by component (`s3://data/team` holds `s3://data/team/x`, not `s3://data/team-b`), and
one with `.` or `..` components is refused. Ray-free and torch-free."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from actors.storage.storage_uri import StorageURI, as_location, is_uri

Location = Path | StorageURI


def as_root(text: str | Path) -> Location:
    """A root as given in a config or a users file: a path (resolved) or a URI prefix."""
    location = as_location(str(text))
    if isinstance(location, StorageURI):
        return StorageURI(str(location).rstrip("/"))
    return Path(os.path.realpath(Path(location).expanduser()))


def is_under(location: Location, root: Location) -> bool:
    if isinstance(location, StorageURI) or isinstance(root, StorageURI):
        if not (isinstance(location, StorageURI) and isinstance(root, StorageURI)):
            return False
        text, prefix = str(location).rstrip("/"), str(root).rstrip("/")
        return text == prefix or text.startswith(prefix + "/")
    return location == root or location.is_relative_to(root)


def _uri_problem(uri: StorageURI, what: str) -> str | None:
    parts = str(uri).split("://", 1)[-1].split("/")
    if any(part in (".", "..") for part in parts):
        return f"{what} {uri} has '.' or '..' components; give the object's full URI"
    return None


def _entries(path: Path) -> Iterator[Path]:
    """The data's real locations: the path itself and, for a folder, everything under it (links resolved)."""
    yield Path(os.path.realpath(path))
    if path.is_dir():
        for folder, folders, files in os.walk(path, followlinks=False):
            for name in [*folders, *files]:
                yield Path(os.path.realpath(Path(folder) / name))


def data_problem(data: str | Path | StorageURI, roots: Sequence[Location] | None,
                 forbidden: Sequence[tuple[Location, str, Location | None]] = (), *, what: str = "data") -> str | None:
    """Why a job may not read `data` (None: it may). `roots`: where it may (None: anywhere but `forbidden`);
    `forbidden`: (location, what it is, a place inside it the job may read or None) triples; `what`: the field
    the messages name (`data`, `init_adapter`)."""
    if is_uri(str(data)):
        uri = StorageURI(str(data))
        problem = _uri_problem(uri, what)
        if problem:
            return problem
        entries: list[Location] = [uri]
    else:
        entries = list(_entries(Path(data).expanduser()))
    for entry in entries:
        for place, place_name, allowed in forbidden:
            if is_under(entry, place) and not (allowed is not None and is_under(entry, allowed)):
                shown = "" if entry == entries[0] else f" ({entry} inside it)"
                return f"{what} {data}{shown} lies in {place_name}, which no job may read"
    if roots is not None:
        for entry in entries:
            if not any(is_under(entry, root) for root in roots):
                shown = "" if entry == entries[0] else f" ({entry}, inside it, links out)"
                listed = ", ".join(str(root) for root in roots) or "none"
                return (f"{what} {data}{shown} is outside the data roots this job may read ({listed}); put it "
                        "under one of them, or ask the operator to add a root (`data_roots` in the service's "
                        "config, or `aspen user add --data-root`)")
    return None
