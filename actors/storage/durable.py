"""Writes that a crash cannot tear: a file is replaced whole or not at all, and stays replaced.

`write_durably` writes the new content to a temporary file in the same folder, fsyncs it, renames it over
the target and fsyncs the folder: after a crash (of the process or the machine) the target holds either
its old content or the complete new one, never a part, and no temporary is left where the write failed in
this process. Checkpoints, which are whole folders, use the same steps by hand: `fsync_tree` on a staging
folder, then `replace_durably`. No torch here: the service and the CLI write their small files with it too."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

Content = bytes | str | Callable[[Path], None]
"""What to write: bytes, text (UTF-8), or a function that writes the (empty, existing) file at the path it
is given, in place."""


def fsync_path(path: str | Path) -> None:
    """fsync a file's content, or a folder's entries (so that a rename into it survives a crash)."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file under `folder`, then the folders themselves (deepest first)."""
    folder = Path(folder)
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            fsync_tree(path)
        else:
            fsync_path(path)
    fsync_path(folder)


def current_umask() -> int:
    """This process's umask (Linux's /proc/self/status; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_folder(parent: str | Path, prefix: str) -> Path:
    """A new, uniquely named folder in `parent` to build a folder in before `replace_durably` puts it in
    place, with the mode `mkdir` gives (0777 less the umask): `tempfile.mkdtemp` makes it 0700, and the
    folder keeps its mode when renamed, so an adapter's checkpoint or an export would be readable by its
    owner alone, unlike every other output."""
    folder = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    folder.chmod(0o777 & ~current_umask())
    return folder


def replace_durably(source: str | Path, target: str | Path) -> None:
    """Rename `source` over `target` (a file or a folder, in the same file system) and fsync the folder that
    holds `target`, so that the rename itself survives a crash."""
    os.replace(source, target)
    fsync_path(Path(target).parent)


def write_durably(path: str | Path, content: Content, *, private: bool = False) -> Path:
    """Replace `path` with `content` crash-safely (see the module docstring); its folder is made when
    missing. The new file gets the mode any new file gets (0666 less the umask), or exactly 0600 from its
    creation on with `private` (for secrets). Returns `path`. On an error the temporary file is deleted,
    `path` is left as it was and the error propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(temporary, flags, 0o600 if private else 0o666)
    try:
        try:
            if private:
                os.fchmod(descriptor, 0o600)   # the umask can only narrow it; this makes it exactly 0600
            if not callable(content):
                view = memoryview(content.encode() if isinstance(content, str) else content)
                while view:
                    view = view[os.write(descriptor, view):]
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
        if callable(content):
            content(temporary)
            # the writer may have made the file anew (safetensors writes 0600): the mode this file was to have
            temporary.chmod(0o600 if private else 0o666 & ~current_umask())
            fsync_path(temporary)
        replace_durably(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def append_whole(descriptor: int, data: bytes) -> None:
    """Append `data` to the end of the file open at `descriptor`, whole or not at all: a write that fails
    part-way (a full disk) is cut back to where it began, so that the file holds no part of a record, and its
    error propagates. Where even the cut fails, the file may keep the part: that error's note says so."""
    end = os.lseek(descriptor, 0, os.SEEK_END)
    view, written = memoryview(data), 0
    try:
        while written < len(view):
            written += os.write(descriptor, view[written:])
    except OSError as error:
        if written:
            try:
                os.ftruncate(descriptor, end)
            except OSError as cut:
                error.add_note(f"and the {written} bytes written could not be cut back: {cut}")
        raise


def append_record(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Append `data` (one or more whole lines) to the file at `path` in one write and fsync it, so that writers
    in several processes (O_APPEND) never interleave or lose a record, and a record is on disk once this returns;
    the file and its folder are made when missing (the file 0600 with `private`). A short write raises OSError
    naming the file (nothing is retried: an action that cannot be recorded is not done)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600 if private else 0o666)
    try:
        written = os.write(descriptor, data)
        if written != len(data):
            raise OSError(f"{path}: only {written} of {len(data)} bytes of a record were written")
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
