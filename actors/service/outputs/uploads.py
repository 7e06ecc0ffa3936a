"""A trainer's background uploads: the mirroring of its jobs' checkpoints and results to their storage URIs
(actors/storage/checkpoint_mirror.py) off the training thread, so that a slow or unreachable store costs the job whose
upload it is its upload, never the other jobs their steps. Ray-free and torch-free.

`Uploads` runs each job's uploads one at a time and in the order they were handed in (two uploads of one
job never overlap: the later one's pointer must be written last), on a few daemon threads shared by all
jobs, so that one job's stuck upload does not hold another's up (and never holds up the process's exit).
Each upload is a `Future`; the trainer loop looks at them between steps.

`snapshot_checkpoint` makes the immutable copy a periodic upload reads while training goes on: hard links
to the checkpoint's files (a save never rewrites a file, it swaps in a new folder: the linked files stay as
they were; a copy where links are not possible) and a copy of the job's appended files (its metrics and
generations)."""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

UPLOAD_THREADS = 4          # jobs whose uploads run at the same time (each job's one at a time)
SNAPSHOT_PREFIX = ".upload-"


class Uploads:
    """Background uploads, serialized per job. `submit(job, work)` returns a Future of `work()`."""

    def __init__(self, name: str, threads: int = UPLOAD_THREADS):
        self.name = name
        self.threads_wanted = threads
        self.condition = threading.Condition()
        self.queues: dict[str, collections.deque[tuple[Callable[[], Any], Future]]] = {}
        self.running: set[str] = set()
        self.threads: list[threading.Thread] = []
        self.closed = False

    def submit(self, job_id: str, work: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self.condition:
            if self.closed:
                raise RuntimeError(f"uploads of {self.name} are closed; no upload of job {job_id} can start")
            self.queues.setdefault(job_id, collections.deque()).append((work, future))
            busy = len(self.running) + sum(1 for j, q in self.queues.items() if q and j not in self.running)
            if len(self.threads) < min(self.threads_wanted, busy):
                thread = threading.Thread(target=self._work, name=f"{self.name}-upload-{len(self.threads)}",
                                          daemon=True)
                self.threads.append(thread)
                thread.start()
            self.condition.notify()
        return future

    def pending(self, job_id: str) -> bool:
        """Whether an upload of this job is running or waiting."""
        with self.condition:
            return job_id in self.running or bool(self.queues.get(job_id))

    def close(self) -> None:
        """No more uploads; the ones still waiting are cancelled (their futures say so). A running one goes on
        in its daemon thread: the caller decided not to wait for it any longer."""
        with self.condition:
            self.closed = True
            for queue in self.queues.values():
                for _, future in queue:
                    future.cancel()
            self.queues.clear()
            self.condition.notify_all()

    def _next(self) -> tuple[str, Callable[[], Any], Future] | None:
        with self.condition:
            while True:
                if self.closed:
                    return None
                for job_id, queue in self.queues.items():
                    if queue and job_id not in self.running:
                        work, future = queue.popleft()
                        if not queue:
                            del self.queues[job_id]
                        self.running.add(job_id)
                        return job_id, work, future
                self.condition.wait()

    def _work(self) -> None:
        while (item := self._next()) is not None:
            job_id, work, future = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(work())
                    except BaseException as error:  # noqa: BLE001 - handed to the trainer loop, which reports it
                        future.set_exception(error)
            finally:
                with self.condition:
                    self.running.discard(job_id)
                    self.condition.notify_all()


def snapshot_checkpoint(local_dir: Path, checkpoint: Path, appended: list[Path]) -> Path:
    """An immutable copy of the job's checkpoint folder (`<snapshot>/checkpoint/`, hard links) and of those of
    its `appended` files that exist (`<snapshot>/<name>`, copied: they grow in place), in a new folder next to
    them (the same file system: links work). Raises OSError (the snapshot is removed)."""
    snapshot = local_dir / f"{SNAPSHOT_PREFIX}{uuid.uuid4().hex[:10]}"
    try:
        for path in sorted(checkpoint.rglob("*")):
            if not path.is_file():
                continue
            target = snapshot / "checkpoint" / path.relative_to(checkpoint)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:   # a file system without hard links: a copy is as immutable
                shutil.copy2(path, target)
        for path in appended:
            if path.is_file():
                snapshot.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, snapshot / path.name)
    except BaseException:
        shutil.rmtree(snapshot, ignore_errors=True)
        raise
    return snapshot


def remove_snapshots(local_dir: Path) -> None:
    """Delete the snapshots an earlier trainer left in a job's folder (it crashed mid-upload)."""
    if local_dir.is_dir():
        for path in local_dir.glob(f"{SNAPSHOT_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)
