"""A trainer's jobs whose output_dir is a storage URI (s3://...): checkpoints mirrored there while they train,
results uploaded when they leave, the newest checkpoint fetched when they start. (The store's API:
actors/storage/storage_location.py, actors/storage/checkpoint_mirror.py.)

Such a job is written to a node-local staging folder (`<staging_dir>/<job id>`) exactly as a local job's
folder, and each complete checkpoint is then mirrored to the URI with its metrics and generations so far;
its adapter goes there when it leaves. A failed upload costs no work: the local checkpoint stays, the next
checkpoint uploads again, and the job's reason says what failed. A job starting on any node first takes the
URI's latest complete checkpoint (or this node's newer one), with the generations.jsonl uploaded beside it
(cut back to that checkpoint when the job starts).

Uploads run in the background (actors/service/outputs/uploads.py), so that a slow or unreachable store stalls no
step: a periodic checkpoint is handed off as an immutable snapshot (hard links), one upload per job at a
time; a checkpoint taken while the job's previous one still uploads is uploaded after it (the newest then,
earlier ones are skipped). A job that leaves (completed, stopped early, paused, cancelled, moved) stops
stepping at once, but is reported ended only when its final adapter, metrics and checkpoint are all uploaded
(the other jobs step meanwhile); one whose final upload fails `FINAL_WRITE_ATTEMPTS` times, or does not end
within `upload_timeout_s`, fails with the URI and the reason. Closing waits for the uploads (bounded)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.checkpoint import has_checkpoint, previous_folder, saved_step
from actors.service.outputs.job_files import CHECKPOINT_FOLDER, GENERATIONS_NAME, METRICS_NAME
from actors.service.outputs.uploads import Uploads, remove_snapshots, snapshot_checkpoint
from actors.service.scheduler.retries import FINAL_WRITE_ATTEMPTS, with_retries
from actors.service.trainer.active_job import ActiveJob, JobMirror
from actors.service.trainer.trainer_reports import EventKind, TrainerEvents
from actors.storage.checkpoint_mirror import download_checkpoint, read_pointer, upload_checkpoint
from actors.storage.storage_errors import CorruptCheckpoint
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import StorageURI

log = logging.getLogger(__name__)

APPENDED = (METRICS_NAME, GENERATIONS_NAME)   # a job's files that grow as it trains: uploaded with each checkpoint


@dataclass(kw_only=True)
class LeavingJob:
    """A job off the steps whose end waits for its final upload: reported as `kind` with `data` once it is
    uploaded, as failed when the upload fails or is not done by `deadline` (monotonic)."""

    active: ActiveJob
    kind: EventKind
    data: dict[str, Any]
    upload: Future
    deadline: float


class RemoteOutputs:
    """The trainer's side of its jobs' storage URIs: the staging folders, the uploads in the background and
    the jobs whose end waits for theirs (`leaving`). Its events go to `events`; `wake` is set whenever an
    upload ends (the loop then takes it with `collect`)."""

    def __init__(self, trainer_id: str, staging_dir: Path, upload_timeout_s: float, events: TrainerEvents,
                 wake: threading.Event):
        self.trainer_id = trainer_id
        self.staging_dir = staging_dir
        self.upload_timeout_s = upload_timeout_s
        self.events = events
        self.wake = wake
        self.uploads = Uploads(trainer_id)
        self.leaving: dict[str, LeavingJob] = {}   # jobs whose end waits for their final upload
        self.closing = threading.Event()           # set: uploads still running write no pointer

    # -- a job's start --------------------------------------------------------------------------------
    def staging_folder(self, job_id: str) -> Path:
        """The job's node-local folder, cleared of the snapshots an earlier trainer left (a crash mid-upload)."""
        local_dir = self.staging_dir / job_id
        remove_snapshots(local_dir)
        return local_dir

    @staticmethod
    def mirror(output_dir: StorageURI, local_dir: Path) -> JobMirror:
        """The job's mirror to `output_dir`; raises StorageError when the store refuses writes there."""
        remote = StorageLocation(str(output_dir))
        remote.check_writable()
        return JobMirror(remote=remote, local_dir=local_dir)

    @staticmethod
    def fetch_checkpoint(mirror: JobMirror, folder: Path) -> str:
        """Put the job's newest checkpoint in its node-local `folder`: the URI's latest complete upload, unless
        this node holds a newer one (uploads that failed; the folder is the job's own, by its unique id), and
        beside it the generations.jsonl uploaded with that checkpoint. Returns a note for the job's reason;
        raises StorageError when the URI cannot be read (the job does not start rather than start over)."""
        remote = mirror.remote
        local = saved_step(folder)
        try:
            pointer = read_pointer(remote)
        except CorruptCheckpoint as error:
            if local is not None:
                return f"its uploaded checkpoint is unusable ({error}); resumed from this node's copy"
            return f"its uploaded checkpoint is unusable, started over: {error}"
        if pointer is None:
            if local is None:
                return ""
            return f"resumed from this node's checkpoint at step {local}: none was uploaded to {remote.uri} yet"
        if local is not None and local > pointer["step"]:
            return (f"resumed from this node's checkpoint at step {local}, newer than the one uploaded to "
                    f"{remote.uri} (step {pointer['step']})")
        try:
            shutil.rmtree(previous_folder(folder), ignore_errors=True)
            download_checkpoint(remote, folder)
            if remote.exists(GENERATIONS_NAME):   # the evaluations so far (the job keeps those up to its step)
                remote.download_file(GENERATIONS_NAME, folder.parent / GENERATIONS_NAME)
        except CorruptCheckpoint as error:
            if local is not None:
                return f"its uploaded checkpoint is unusable ({error}); resumed from this node's copy"
            return f"its uploaded checkpoint is unusable, started over: {error}"
        return ""

    # -- while it trains ------------------------------------------------------------------------------
    def checkpoint_saved(self, active: ActiveJob, step: int) -> None:
        """The job saved a checkpoint at `step`: uploaded in the background, after the previous one if that
        still uploads (its event when the upload ends, `collect`)."""
        mirror = active.mirror
        assert mirror is not None
        mirror.checkpoint_step = step
        if mirror.upload is None:
            self._upload_checkpoint(active)
        else:   # the previous one still uploads: the newest checkpoint goes after it
            mirror.upload_due = True

    def _upload_checkpoint(self, active: ActiveJob) -> None:
        """Hand the job's newest checkpoint (and its metrics and generations) to the background uploads as a
        snapshot; the result is taken by `collect`. A snapshot that cannot be made is a failed upload."""
        mirror = active.mirror
        assert mirror is not None
        remote, step = mirror.remote, mirror.checkpoint_step   # steps may have run since it was saved
        mirror.upload_due = False
        mirror.upload_step = step
        try:
            snapshot = snapshot_checkpoint(active.local_dir, active.checkpoint_dir,
                                           [active.local_dir / name for name in APPENDED])
        except OSError as error:
            failed: Future = Future()
            failed.set_exception(error)
            mirror.upload = failed
            return

        def upload() -> dict[str, Any]:
            try:
                for name in APPENDED:
                    if (snapshot / name).is_file():
                        remote.upload_file(snapshot / name, name)
                return upload_checkpoint(remote, snapshot / CHECKPOINT_FOLDER, step,
                                         go_on=lambda: self._go_on(mirror))
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

        mirror.upload = self.uploads.submit(active.job_id, upload)
        mirror.upload.add_done_callback(lambda _: self.wake.set())

    def _go_on(self, mirror: JobMirror) -> bool:
        """Whether the job's upload may still move its pointer: not once its trainer or the job gave up on it
        (it may be resuming elsewhere meanwhile)."""
        return not self.closing.is_set() and not mirror.abandoned.is_set()

    def collect(self, running: dict[str, ActiveJob]) -> None:
        """Take the background uploads that ended: a periodic checkpoint's event (and the next upload, where a
        newer checkpoint waits) of the `running` jobs and the leaving ones, a leaving job's end; a leaving job
        past its deadline fails."""
        for active in [*running.values(), *(leaving.active for leaving in self.leaving.values())]:
            if active.mirror is not None and active.mirror.upload is not None and active.mirror.upload.done():
                self._uploaded(active, still_running=running.get(active.job_id) is active)
        now = time.monotonic()
        for job_id, leaving in list(self.leaving.items()):
            active, mirror = leaving.active, leaving.active.mirror
            assert mirror is not None
            if leaving.upload.done() and mirror.upload is None:
                error = leaving.upload.exception()
                if error is None:
                    if leaving.kind in ("completed", "stopped_early"):
                        leaving.data["adapter_dir"] = mirror.remote.uri
                    active.report_end(self.events, leaving.kind, leaving.data)
                else:
                    log.warning("trainer %s: job %s: uploading its results to %s failed: %s", self.trainer_id,
                                job_id, mirror.remote.uri, error)
                    self._report_upload_failed(leaving, f"uploading its results to {mirror.remote.uri} failed "
                                                        f"{FINAL_WRITE_ATTEMPTS} times: {error}")
            elif now >= leaving.deadline:
                mirror.abandoned.set()   # should it end after all, it moves no pointer
                self._report_upload_failed(leaving, f"uploading its results to {mirror.remote.uri} did not end "
                                                    f"within {self.upload_timeout_s:g}s (upload_timeout_s)")
            else:
                continue
            del self.leaving[job_id]

    def _uploaded(self, active: ActiveJob, *, still_running: bool) -> None:
        """A periodic checkpoint's upload ended: its `checkpoint` event; a newer checkpoint's upload next."""
        mirror = active.mirror
        assert mirror is not None and mirror.upload is not None
        upload, step, job_id, remote = mirror.upload, mirror.upload_step, active.job_id, mirror.remote
        mirror.upload = None
        error = upload.exception()
        if error is not None:   # the local checkpoint stays; the next checkpoint uploads again
            mirror.upload_error = (f"uploading its checkpoint at step {step} to {remote.uri} failed ({error}); it is "
                                   f"kept on {self.trainer_id} and uploaded again at the next checkpoint")
            log.warning("trainer %s: job %s: %s", self.trainer_id, job_id, mirror.upload_error)
            self.events.emit("checkpoint", job_id, step, upload_error=mirror.upload_error)
        else:
            recovered = mirror.upload_error is not None
            mirror.upload_error = None
            self.events.emit("checkpoint", job_id, step, uploaded=remote.uri, upload_recovered=recovered)
        if mirror.upload_due and still_running:
            self._upload_checkpoint(active)

    # -- its end --------------------------------------------------------------------------------------
    def leave(self, active: ActiveJob, kind: EventKind, data: dict[str, Any]) -> None:
        """Upload a leaving job's results in the background (after its periodic upload, if one runs); its end
        is reported when that is done (`collect`)."""
        mirror, local_dir, step = active.mirror, active.local_dir, active.job.step
        assert mirror is not None
        remote = mirror.remote
        outputs = kind in ("completed", "stopped_early")

        def go_on() -> bool:
            return self._go_on(mirror)

        def warn(error: OSError, attempt: int, last: bool) -> None:
            if not last:
                log.warning("trainer %s: job %s: uploading its results to %s failed (%d of %d attempts): %s",
                            self.trainer_id, active.job_id, remote.uri, attempt, FINAL_WRITE_ATTEMPTS, error)

        def upload() -> None:
            with_retries(lambda: upload_results(remote, local_dir, step, outputs, go_on), on_failure=warn,
                         go_on=go_on)

        deadline = time.monotonic() + self.upload_timeout_s
        future = self.uploads.submit(active.job_id, upload)
        future.add_done_callback(lambda _: self.wake.set())
        self.leaving[active.job_id] = LeavingJob(active=active, kind=kind, data=data, upload=future, deadline=deadline)

    def _report_upload_failed(self, leaving: LeavingJob, why: str) -> None:
        data = leaving.data
        data["reason"] = (f"{data['reason']}; then {why}; its checkpoint at step {data.get('checkpoint_step')} is "
                          f"kept on {self.trainer_id}'s node: make the store reachable, then resume the job")
        data.pop("retry", None)
        leaving.active.report_end(self.events, "failed", data)

    def close(self, timeout: float) -> None:
        """Wait up to `timeout` for the leaving jobs' uploads and report their ends; those not done by then
        fail (their uploads write no pointer any more). The uploads are closed."""
        deadline = time.monotonic() + timeout
        while self.leaving and time.monotonic() < deadline:
            self.collect({})
            self.wake.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            self.wake.clear()
        for leaving in self.leaving.values():
            leaving.deadline = min(leaving.deadline, time.monotonic())
        self.closing.set()
        self.collect({})
        self.uploads.close()


def upload_results(remote: StorageLocation, local_dir: Path, step: int, outputs: bool,
                   go_on: Callable[[], bool] | None = None) -> None:
    """Mirror a job's files to its URI: its metrics and generations, with `outputs` every file at the top of its
    local folder (the adapter), then its checkpoint (the pointer last; not written once `go_on()` is False). Raises
    StorageError."""
    for path in sorted(local_dir.iterdir()):
        if path.is_file() and not path.name.startswith(".") and (outputs or path.name in APPENDED):
            remote.upload_file(path, path.name)
    if has_checkpoint(local_dir / CHECKPOINT_FOLDER):
        upload_checkpoint(remote, local_dir / CHECKPOINT_FOLDER, step, go_on=go_on)
