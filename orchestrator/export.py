"""`aspen export JOB`: find a job's final adapter and hand it off (actors/checkpoint/adapter_export.py): a PEFT folder
for vLLM's `--lora-modules` or PEFT, or with `--merge` the base with the adapter merged, as a transformers
folder.

JOB is found, in this order: a job folder (a path or a storage URI holding adapter_config.json); with
`--from DIR` (a run's output folder or a service's state folder), `DIR/JOB`, `DIR/outputs/JOB` or the job of
that id or name in DIR's job table; otherwise the job of that id or name in the running service (`aspen
serve`, on the Ray cluster at --address), whose folder must be reachable from here (a shared mount or a
storage URI)."""

from __future__ import annotations

import io
import shutil
import sqlite3
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.checkpoint.adapter_export import ExportError, export_adapter, export_merged, has_adapter
from actors.checkpoint.peft_names import CONFIG_NAME, WEIGHTS_NAME
from actors.service.table.table_backup import JobTableDamaged, damaged_message, is_damage
from actors.storage.base_identity import METADATA_NAME
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import as_location, is_uri

FINISHED = ("completed", "stopped_early")
CHECKPOINT_FOLDER = "checkpoint"
DOWNLOADED = ("adapter_config.json", "adapter_model.safetensors", "aspen.json")


@dataclass
class FoundJob:
    name: str
    folder: str                # a local path or a storage URI
    state: str | None = None   # from a job table, where there is one
    step: int | None = None
    total_steps: int | None = None


def _job_tables(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "jobs.sqlite", run_dir / ".aspen" / "jobs.sqlite") if p.is_file()]


def _from_table(database: Path, job: str) -> FoundJob | None:
    """The newest job of id or name `job` in a job table (read-only); KeyError when a name is ambiguous."""
    db = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id, name, output_dir, state, step, total_steps FROM jobs WHERE id = ? OR name = ? "
                          "ORDER BY submitted_at DESC", (job, job)).fetchall()
    except sqlite3.DatabaseError as error:
        if not is_damage(error):
            raise
        raise JobTableDamaged(damaged_message(database, error)) from None
    finally:
        db.close()
    exact = [row for row in rows if row[0] == job]
    if exact:
        rows = exact
    elif len(rows) > 1:
        raise KeyError(f"{len(rows)} jobs in {database} are named '{job}' ({', '.join(r[0] for r in rows)}); give "
                       "its id")
    if not rows:
        return None
    job_id, name, output_dir, state, step, total_steps = rows[0]
    return FoundJob(name, output_dir, state, step, total_steps)


def find_job(job: str, *, run_dir: str | None = None, service: Callable[[str], Any] | None = None) -> FoundJob:
    """The job's folder (module docstring). `service(job)`: the running service's record of a job (KeyError
    when it has none); asked only when nothing local names the job."""
    if is_uri(job) or Path(job).is_dir():
        location = as_location(job)
        return FoundJob(location.name if is_uri(job) else Path(job).resolve().name, str(job))
    if run_dir is not None:
        if is_uri(run_dir):
            for prefix in ("", "outputs/"):
                if StorageLocation(str(run_dir)).exists(f"{prefix}{job}/adapter_config.json"):
                    return FoundJob(job, f"{str(run_dir).rstrip('/')}/{prefix}{job}")
        else:
            root = Path(run_dir)
            if not root.is_dir():
                raise FileNotFoundError(f"--from {run_dir}: no such folder")
            for database in _job_tables(root):
                found = _from_table(database, job)
                if found is not None:
                    return found
            for candidate in (root / job, root / "outputs" / job):
                if candidate.is_dir():
                    return FoundJob(job, str(candidate))
        raise KeyError(f"no job '{job}' in {run_dir}: neither {run_dir}/{job}, {run_dir}/outputs/{job} nor its job "
                       "table; give the job's folder, or its id or name as `aspen status` shows it")
    if service is None:
        raise KeyError(f"no job '{job}': it is not a folder; give the job's folder, or --from with the run's output "
                       "folder or the service's state folder")
    record = service(job)
    return FoundJob(record.name, record.output_dir, record.state, record.step, record.total_steps)


def _no_adapter(found: FoundJob, where: str) -> ExportError:
    of = f" of {found.total_steps}" if found.total_steps is not None else ""   # a budget known once it started
    state = f" is {found.state} (step {found.step}{of}) and" if found.state else ""
    # a local job folder without a checkpoint (one that ended before its first): --checkpoint is no way on
    checkpointed = is_uri(found.folder) or has_adapter(Path(found.folder) / CHECKPOINT_FOLDER)
    if found.state in FINISHED and not Path(found.folder).exists():
        advice = (f"its folder {found.folder} is not on this machine; run `aspen export` where it is, or give the "
                  "service an output root every machine reaches (a shared mount or a storage URI)")
    elif found.state in FINISHED:
        advice = (f"its folder {found.folder} has lost its adapter files; restore them, or export its checkpoint "
                  "(--checkpoint)")
    elif found.state in ("running", "queued", "paused", None):
        advice = ("wait until it completes (`aspen status " + found.name + "`; a run that ended before it did: "
                  "`aspen run` its jobs file again to finish it)" + (", or export its last checkpoint now with "
                                                                      "--checkpoint" if checkpointed else ""))
    elif not checkpointed:
        advice = (f"it ended before its first checkpoint, so there is none to export either; `aspen status "
                  f"{found.name}` says why it ended: fix that, then train it again (`aspen run` its jobs file, or "
                  "`aspen resume` on a service)")
    else:
        advice = ("it did not complete; export its last checkpoint with --checkpoint, or train it on from there "
                  "(`aspen run` its jobs file again, or `aspen resume` on a service)")
    return ExportError(f"job '{found.name}'{state} has no final adapter in {where}: {advice}")


def _local_adapter(found: FoundJob, checkpoint: bool, scratch: Path) -> Path:
    """The local folder holding the adapter to export (downloaded into `scratch` from a storage URI)."""
    name = f"{CHECKPOINT_FOLDER}/" if checkpoint else ""
    if is_uri(found.folder):
        location = StorageLocation(found.folder)
        if checkpoint:
            from actors.storage.checkpoint_mirror import download_checkpoint

            if download_checkpoint(location, scratch / CHECKPOINT_FOLDER) is None:
                raise ExportError(f"job '{found.name}' has no uploaded checkpoint in {found.folder}")
            if not (scratch / CHECKPOINT_FOLDER / METADATA_NAME).is_file() and location.exists(METADATA_NAME):
                location.download_file(METADATA_NAME, scratch / CHECKPOINT_FOLDER / METADATA_NAME)   # see below
            return scratch / CHECKPOINT_FOLDER
        if not location.exists("adapter_config.json"):
            raise _no_adapter(found, found.folder)
        for file in DOWNLOADED:
            if location.exists(file):
                location.download_file(file, scratch / file)
        return scratch
    folder = Path(found.folder) / name
    if not has_adapter(folder):
        if checkpoint:
            raise ExportError(f"job '{found.name}' has no checkpoint in {folder}")
        raise _no_adapter(found, str(folder))
    if found.state is not None and found.state not in FINISHED and not checkpoint:
        raise _no_adapter(found, str(folder))   # an adapter from an earlier run of the same folder
    if checkpoint and not (folder / METADATA_NAME).is_file() and (folder.parent / METADATA_NAME).is_file():
        # a checkpoint saved before checkpoints recorded their base: the job's final adapter's record names it
        for file in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copyfile(folder / file, scratch / file)
        shutil.copyfile(folder.parent / METADATA_NAME, scratch / METADATA_NAME)
        return scratch
    return folder


def export_job(job: str, out: str | Path | None = None, *, merge: bool = False, force: bool = False,
               checkpoint: bool = False, run_dir: str | None = None, base: str | None = None, dtype: str = "auto",
               service: Callable[[str], Any] | None = None) -> Path:
    """Export the job's final adapter (`checkpoint`: its last checkpoint's) to `out` (default
    `./<job name>-lora`, with `merge` `./<job name>-merged`); returns the folder written."""
    found = find_job(job, run_dir=run_dir, service=service)
    out = Path(out) if out is not None else Path.cwd() / f"{found.name}-{'merged' if merge else 'lora'}"
    with tempfile.TemporaryDirectory(prefix="aspen-export-") as scratch:
        # what is wrong with the job (no adapter, no checkpoint) first: a new --out would not help with that
        adapter = _local_adapter(found, checkpoint, Path(scratch))
        if out.exists() and not force:
            raise ExportError(f"{out} exists; give --force to replace it, or another --out")
        if merge:
            return export_merged(adapter, out, base=base, dtype=dtype, force=force)
        return export_adapter(adapter, out, force=force)



def adapter_archive(found: FoundJob, *, checkpoint: bool = False) -> bytes:
    """The job's adapter as `aspen export` writes it (a PEFT folder), packed as a gzipped tar of that folder's
    files (what `GET /v1/jobs/{job}/adapter` sends); ExportError where the job has none (the message says why
    and what to do)."""
    with tempfile.TemporaryDirectory(prefix="aspen-export-") as scratch:
        (Path(scratch) / "adapter").mkdir()
        adapter = _local_adapter(found, checkpoint, Path(scratch) / "adapter")
        folder = export_adapter(adapter, Path(scratch) / "out")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            for file in sorted(folder.iterdir()):
                archive.add(file, arcname=file.name)
        return buffer.getvalue()


def unpack_adapter(archive: bytes, out: Path, *, force: bool = False) -> Path:
    """Write an adapter archive (`adapter_archive`) into the folder `out`, refusing members that are not plain
    files at its top level (tarfile's `data` filter, and no folders: nothing lands outside `out`)."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; give --force to replace it, or another --out")
    with tempfile.TemporaryDirectory(prefix="aspen-export-", dir=out.parent if out.parent.is_dir() else None) \
            as scratch:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as packed:
            members = packed.getmembers()
            wrong = [m.name for m in members if not m.isfile() or "/" in m.name or m.name in ("", ".", "..")]
            if wrong:
                raise ExportError(f"the adapter archive holds {', '.join(wrong[:3])}: not an aspen adapter archive")
            packed.extractall(scratch, filter="data")
        if not has_adapter(Path(scratch)):
            raise ExportError("the adapter archive holds no adapter_config.json and adapter_model.safetensors")
        return export_adapter(Path(scratch), out, force=force)
