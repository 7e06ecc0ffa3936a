"""`actors.storage.durable.write_durably`, the one way aspen replaces a file crash-safely: a write that fails
half-way (an error in this process, or the process killed outright) leaves the old content intact and, in
this process, no temporary file; the new content is on disk (fsynced) before the rename, and the rename is
made durable (the folder fsynced) after it; the file gets the mode an ordinary new file gets, or exactly
0600 with `private`."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.storage.durable import write_durably

REPO = Path(__file__).resolve().parents[3]
OLD = b"the old, complete content\n"


class Interrupted(Exception):
    """The error a write is interrupted with."""


def leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    target.write_bytes(OLD)

    def half_then_fail(path: Path) -> None:          # a writer that dies after writing part of the file
        with open(path, "wb") as handle:
            handle.write(b"the new con")
            handle.flush()
            raise Interrupted("died half-way")

    with pytest.raises(Interrupted):
        write_durably(target, half_then_fail)
    assert target.read_bytes() == OLD and leftovers(tmp_path, target.name) == []

    real_write = os.write
    calls: list[int] = []

    def short_then_fail(descriptor: int, data) -> int:   # the disk fills up after the first bytes
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(descriptor, bytes(data[:4]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_fail)
    with pytest.raises(OSError, match="No space left"):
        write_durably(target, b"x" * 1000)
    monkeypatch.setattr(os, "write", real_write)
    assert calls == [1000, 996]
    assert target.read_bytes() == OLD and leftovers(tmp_path, target.name) == []

    def failing_replace(*args, **kwargs):
        raise Interrupted("the rename failed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(Interrupted):
        write_durably(target, "complete, but never renamed")
    monkeypatch.undo()
    assert target.read_bytes() == OLD and leftovers(tmp_path, target.name) == []

    write_durably(target, "the new content\n")       # and a write that succeeds replaces it whole
    assert target.read_text() == "the new content\n" and leftovers(tmp_path, target.name) == []


CHILD = """
import os, sys
sys.path.insert(0, {repo!r})
from actors.storage.durable import write_durably
real_write = os.write
def dying_write(descriptor, data):
    real_write(descriptor, bytes(data[:len(data) // 2]))
    os._exit(17)   # killed mid-write: no cleanup, no finally
os.write = dying_write
write_durably({target!r}, b"n" * 100_000)
"""


def test_a_process_killed_mid_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(OLD)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD.format(repo=str(REPO), target=str(target)))],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 17, child.stderr
    assert target.read_bytes() == OLD
    # the killed process left its partial temporary beside the file, under a hidden name of its own
    [partial] = leftovers(tmp_path, target.name)
    assert partial.startswith(f".{target.name}.") and partial.endswith(".tmp")
    assert 0 < (tmp_path / partial).stat().st_size < 100_000


def test_the_content_is_synced_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "adapter_config.json"      # the folder is made
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, destination, *args, **kwargs):
        events.append(("replace", str(source)))
        return real_replace(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_durably(target, b"{}\n")
    monkeypatch.undo()
    [(_, temporary)] = [e for e in events if e[0] == "replace"]
    assert events == [("fsync", temporary), ("replace", temporary), ("fsync", str(target.parent))]
    assert target.read_bytes() == b"{}\n"


def test_modes_an_ordinary_file_and_a_private_one(tmp_path):
    previous = os.umask(0o022)
    try:
        ordinary = tmp_path / "ordinary"
        with open(ordinary, "w") as handle:        # the reference: what Python's open() creates
            handle.write("x")
        written = write_durably(tmp_path / "written", "x")
        os.umask(0)                                # a file created the ordinary way would be open to all
        secret = write_durably(tmp_path / "secret", "token\n", private=True)
        replaced = tmp_path / "replaced"
        replaced.write_text("old")
        replaced.chmod(0o644)
        write_durably(replaced, "new", private=True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode) == 0o644
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(replaced.stat().st_mode) == 0o600 and replaced.read_text() == "new"


def test_a_jobs_adapter_and_checkpoint_get_the_modes_of_ordinary_files_and_folders(tmp_path, tiny_model_dirs,
                                                                                    tiny_base):
    """What a run writes for users to share (the adapter, aspen.json, the checkpoint folder and its files) has
    the modes Python's open() and mkdir give under the same umask, as PEFT's save_pretrained writes an
    adapter: not 0600 / 0700, which `tempfile` would leave on them."""
    from actors.service.scheduler.local_run import train_locally
    from tests.helpers.service import job_dict, run_spec, write_task_data

    previous = os.umask(0o022)
    try:
        (tmp_path / "reference-folder").mkdir()
        with open(tmp_path / "reference-file", "w") as handle:
            handle.write("x")
        data = write_task_data(tmp_path / "data", "modes")
        spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                        [job_dict("modes", data, 2, checkpoint_every=1)], step_tokens=512)
        train_locally(spec, base=tiny_base, progress=False)
    finally:
        os.umask(previous)
    file_mode = stat.S_IMODE((tmp_path / "reference-file").stat().st_mode)
    folder_mode = stat.S_IMODE((tmp_path / "reference-folder").stat().st_mode)
    job = tmp_path / "out" / "modes"
    written = [job, *job.rglob("*")]
    assert {"adapter_model.safetensors", "adapter_config.json", "aspen.json", "checkpoint"} <= {p.name for p in written}
    assert len([p for p in written if p.parent.name == "checkpoint"]) >= 3
    wrong = {str(p.relative_to(job)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written
             if stat.S_IMODE(p.stat().st_mode) != (folder_mode if p.is_dir() else file_mode)}
    assert not wrong, (oct(file_mode), oct(folder_mode), wrong)


APPENDER = """
import sys
from actors.storage.durable import append_record
for i in range(200):
    append_record(sys.argv[1], (sys.argv[2] * 300 + f" {i}\\n").encode(), private=True)
"""


def test_records_appended_from_several_processes_stay_whole_and_private(tmp_path, monkeypatch):
    """append_record: two processes appending at once never interleave a record; every one is there, fsynced
    before the call returns; a private file is 0600; a short write is an error naming the file."""
    path = tmp_path / "log" / "records.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    writers = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), letter], env=env) for letter in "ab"]
    assert all(writer.wait(timeout=120) == 0 for writer in writers)
    lines = path.read_text().splitlines()
    assert len(lines) == 400 and all(line[:300] in ("a" * 300, "b" * 300) and line[300] == " " for line in lines)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    from actors.storage.durable import append_record

    append_record(path, b"x\n")
    assert synced
    monkeypatch.setattr(os, "write", lambda fd, data: len(data) - 1)
    with pytest.raises(OSError, match="records.jsonl: only 1 of 2 bytes"):
        append_record(path, b"y\n")
