"""The trainer actor's core: one base model, fused steps over whatever jobs are assigned, run
continuously. Jobs join at the next step boundary and leave (finished, stopped early, cancelled, paused,
failed) with a checkpoint and their adapter written out, without the trainer restarting.

One job's trouble stays that job's: a job whose data does not arrive within `data_grace_s` is left out of
the steps (the others go on), and after `data_timeout_s` it is checkpointed and given back to the
scheduler, as is a job whose job actor died; a job whose folder refuses writes fails after a few tries
with the reason. Checkpoints are written every `checkpoint_every` steps and every `checkpoint_every_s`
seconds, so that a crash loses bounded work.

A job whose output_dir is a storage URI (s3://..., actors/engine/storage.py) is written to a node-local
staging folder (`<staging_dir>/<job id>`) exactly as a local job's folder, and each complete checkpoint is
then mirrored to the URI; its adapter and metrics go there when it leaves. A failed upload costs no work:
the local checkpoint stays, the next checkpoint uploads again, and the job's reason says what failed. A job
starting on any node first takes the URI's latest complete checkpoint (or this node's newer one).

Uploads run in the background (actors/service/uploads.py), so that a slow or unreachable store stalls no
step: a periodic checkpoint is handed off as an immutable snapshot (hard links), one upload per job at a
time; a checkpoint taken while the job's previous one still uploads is uploaded after it (the newest then,
earlier ones are skipped). A job that leaves (completed, stopped early, paused, cancelled, moved) stops
stepping at once, but is reported ended only when its final adapter, metrics and checkpoint are all uploaded
(the other jobs step meanwhile); one whose final upload fails `FINAL_WRITE_ATTEMPTS` times, or does not end
within `upload_timeout_s`, fails with the URI and the reason. `close` waits for the uploads (bounded).

Thread-safe entry points (`assign`, `stop_job`, `drain_events`, `status`) only queue commands or copy
state; the fused steps themselves run in one thread, one `run_once` at a time."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from actors.engine.base_identity import base_identity
from actors.engine.checkpoint import (
    CheckpointError,
    has_checkpoint,
    load_checkpoint,
    previous_folder,
    save_checkpoint,
    saved_step,
)
from actors.engine.data import Example
from actors.engine.job import TrainingJob
from actors.engine.lora import linear_module_names, remove_adapter
from actors.engine.loss import DEFAULT_CHUNK, logits_transient_bytes
from actors.engine.memory_prior import StepMemoryPrior, loss_transient_bytes, probe_base_activation
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch
from actors.engine.peft_io import save_adapter
from actors.engine.spec import JobSubmission
from actors.engine.storage import (
    CorruptCheckpoint,
    StorageLocation,
    StorageURI,
    as_location,
    download_checkpoint,
    is_uri,
    read_pointer,
    upload_checkpoint,
)
from actors.engine.trainer import FusedTrainer, StepReport
from actors.service.config import TrainerConfig, trainer_step_log
from actors.service.feed import Done, FeedChunk, JobLinkLost, MicroBatchFeed, Pending, wait_for
from actors.service.job_data import VERDICT_LAG, DataSummary, JobData, JobUpdate
from actors.service.job_files import METRICS_NAME, JobFiles
from actors.service.tracking import CLOSE_WAIT_S, JobTracker, start_tracker
from actors.service.trainer_reports import TrainerEvent, TrainerStatus
from actors.service.uploads import Uploads, remove_snapshots, snapshot_checkpoint
from policies.base import StepComposer
from policies.memory_model import MemoryModel, StepShape
from policies.stopping import Verdict

log = logging.getLogger(__name__)

CHECKPOINT_FOLDER = "checkpoint"
# A job's stop verdict for optimizer step k (its job actor's answer to that step's update) takes effect
# after step k + VERDICT_LAG - 1, however early or late it arrives: before the job's step k + VERDICT_LAG
# starts, the trainer has that answer (waiting for it like for late data) and applies the verdicts up to
# it, never one after it. So the step a job stops at depends on its losses alone, not on how busy its job
# actor was; the answer has a whole step's time to arrive. (VERDICT_LAG is job_data's: a resumed job's data
# makes its last VERDICT_LAG steps' decisions again.)
MEASURE_FIRST = 3      # CPU: the first steps whose peak the allocator counts (the memory model's first data)
MEASURE_EVERY = 20     # CPU: and every this many steps after
MEMORY_MARGIN = 0.06   # a step is composed only if its predicted peak plus this share fits the budget (the
                       # prediction's goal is 6% at most off the allocator; bench/memory.py measured 4.7% low once)
FINAL_WRITE_ATTEMPTS = 3          # tries to write a leaving job's adapter and checkpoint
FINAL_WRITE_BACKOFF_S = (0.2, 1.0)
CLOSE_UPLOAD_WAIT_S = 120.0       # at most this long (and upload_timeout_s) a closing trainer waits for uploads


class JobLink(Protocol):
    """The trainer's line to a job's data and history (its job actor, or a `JobData` in-process)."""

    def fetch(self, position: dict[str, Any], count: int) -> Pending[FeedChunk]: ...

    def update(self, update: JobUpdate) -> Pending[Verdict]: ...


class LocalJobLink:
    """A `JobLink` to a `JobData` in this process."""

    def __init__(self, data: JobData):
        self.data = data

    def fetch(self, position: dict[str, Any], count: int) -> Done[FeedChunk]:
        return Done(self.data.fetch(position, count))

    def update(self, update: JobUpdate) -> Done[Verdict]:
        return Done(self.data.update(update))


@dataclass
class Assignment:
    job_id: str
    submission: JobSubmission
    output_dir: Path | StorageURI
    data: DataSummary
    eval_examples: list[Example]
    link: JobLink

    def __post_init__(self) -> None:
        self.output_dir = as_location(self.output_dir)   # a URI that went through Path() gets its "//" back


@dataclass
class ActiveJob:
    assignment: Assignment
    job: TrainingJob
    feed: MicroBatchFeed
    files: JobFiles
    local_dir: Path                      # where its files are written: output_dir, or a staging folder
    remote: StorageLocation | None       # output_dir when it is a storage URI
    decisions: list[tuple[int, Pending[Verdict]]] = field(default_factory=list)   # (step, its verdict)
    last_step_time: float = field(default_factory=time.time)
    last_eval_step: int = -1
    last_checkpoint: float = field(default_factory=time.monotonic)
    stalled_since: float | None = None   # when its data was first late (monotonic), while it is
    upload_error: str | None = None      # why its last checkpoint upload failed, until one succeeds
    tracker: JobTracker | None = None    # its TensorBoard / MLflow tracking (`tracking:` of its spec)
    upload: Future | None = None         # its periodic checkpoint's upload in the background, while it runs
    upload_step: int = 0                 # the step of that checkpoint
    checkpoint_step: int = 0             # the step of its newest checkpoint on this node
    upload_due: bool = False             # a newer checkpoint waits for that upload to end
    abandoned: threading.Event = field(default_factory=threading.Event)   # set: its uploads write no pointer

    @property
    def checkpoint_dir(self) -> Path:
        return self.local_dir / CHECKPOINT_FOLDER


@dataclass
class LeavingJob:
    """A job off the steps whose end waits for its final upload: reported as `kind` with `data` once it is
    uploaded, as failed when the upload fails or is not done by `deadline` (monotonic)."""

    active: ActiveJob
    kind: str
    data: dict[str, Any]
    upload: Future
    deadline: float


def default_memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.5)


def memory_in_use(device: torch.device) -> int:
    """Memory held right now: the CUDA allocator's allocated bytes, or this process's resident set on CPU
    (Linux's /proc/self/statm; 0, with a warning once, where there is none)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError as error:
        _warn_once(f"memory in use is reported as 0: cannot read the resident set size ({error})")
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def activation_bytes_estimate(model: torch.nn.Module, tokens: int, dtype: torch.dtype) -> int:
    """A first guess of a step's memory over the weights before any step has been measured: per token
    and layer about 12 hidden-sized and 3 intermediate-sized tensors (attention, norms, MLP) are kept for
    backward, plus the loss's largest transient (one chunk of logits over the vocabulary)."""
    config = model.config
    hidden = getattr(config, "hidden_size", 0)
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    layers = getattr(config, "num_hidden_layers", 1)
    width = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    vocab = getattr(config, "vocab_size", 0)
    return tokens * layers * (12 * hidden + 3 * intermediate) * width + logits_transient_bytes(DEFAULT_CHUNK, vocab,
                                                                                               tokens)


class TrainerLoop:
    def __init__(self, base: BaseModel, config: TrainerConfig, trainer_id: str, state_dir: Path,
                 composer: StepComposer | None = None):
        """`composer`: the service policy's `compose_step`, where it has one (e.g. MinPad)."""
        self.base = base
        self.config = config
        self.trainer_id = trainer_id
        self.trainer = FusedTrainer(base, step_tokens=config.step_tokens, layout=config.layout, composer=composer,
                                    recompute=config.recompute, compile=config.compile)
        self.incarnation = uuid.uuid4().hex[:12]
        self.commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.events: list[TrainerEvent] = []
        self.active: dict[str, ActiveJob] = {}
        self.started_at = time.time()
        self.busy_seconds = 0.0
        self.tokens = 0
        self.padding_tokens = 0
        self.peak_memory = 0
        self.data_waits = 0
        model = base.model
        self.base_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        self.budget = config.memory_budget_bytes or default_memory_budget(base.device)
        self.linear_shapes = {name: (model.get_submodule(name).in_features, model.get_submodule(name).out_features)
                              for name in linear_module_names(model)}
        # the base's activation bytes per token, measured on this model (dtype, quantization, layout,
        # recompute mode) by two small probe steps; the adapters' and the loss's bytes are analytic per step
        activation = probe_base_activation(base, layout=config.layout, recompute=config.recompute)
        self.memory_prior = StepMemoryPrior(base, activation, self.linear_shapes, recompute=config.recompute)
        self.memory_model = MemoryModel.for_model(self.base_bytes + activation.constant, activation.per_token,
                                                  bytes_per_adapter_parameter=activation.bytes_per_adapter_parameter)
        self.activation_estimate = int(activation.constant + activation.per_token * config.step_tokens
                                       + loss_transient_bytes(config.step_tokens, self.memory_prior.vocab,
                                                              self.memory_prior.hidden, base.dtype))
        self.measured_steps = 0
        self.under_predictions: collections.deque[float] = collections.deque(maxlen=100)
        self.longest_sequence = 0
        self.step_log_path = trainer_step_log(config, Path(state_dir), trainer_id)
        self.step_log_path.parent.mkdir(parents=True, exist_ok=True)
        self.step_log = self.step_log_path.open("a")
        self.step_log_failing = False
        self.staging_dir = Path(config.staging_dir or Path(state_dir) / "staging").expanduser()
        self.job_ids: list[str] = []   # for status(), replaced (not mutated) by the loop thread
        # what adapters record as their base: an id a serving engine resolves, and where it was loaded from
        self.base_identity = base_identity(base.name, base.source, quantization=base.quantization,
                                           dtype=str(base.dtype).removeprefix("torch."))
        self.trackers: list[JobTracker] = []   # trackers still writing (waited for at close)
        self.uploads = Uploads(trainer_id)
        self.leaving: dict[str, LeavingJob] = {}   # jobs whose end waits for their final upload
        self.closing = threading.Event()           # set: uploads still running write no pointer
        self.waiting_starts: list[Assignment] = []  # jobs assigned again while still leaving here

    # -- thread-safe entry points -------------------------------------------------------------------
    def assign(self, assignments: Assignment | list[Assignment]) -> None:
        """Start jobs at the next step boundary (a list starts together)."""
        self.commands.put(("assign", assignments if isinstance(assignments, list) else [assignments]))
        self.wake.set()

    def stop_job(self, job_id: str, kind: str, reason: str) -> None:
        """End a job at the next step boundary: `cancelled` or `paused` (both checkpoint it first)."""
        if kind not in ("cancelled", "paused"):
            raise ValueError(f"stop kind must be 'cancelled' or 'paused', not '{kind}'")
        self.commands.put(("stop", job_id, kind, reason))
        self.wake.set()

    def drain_events(self) -> list[TrainerEvent]:
        with self.lock:
            events, self.events = self.events, []
        return events

    def status(self) -> TrainerStatus:
        return TrainerStatus(self.trainer_id, self.incarnation, self.base.name, self.base.quantization,
                             str(self.base.device), list(self.job_ids), self.trainer.step_count, self.tokens,
                             self.padding_tokens, self.busy_seconds, self.started_at, self.base_bytes,
                             self.peak_memory, self.budget, self.activation_estimate, dict(self.linear_shapes),
                             self.data_waits, tuple(self.memory_model.coefficients.tolist()),
                             self.memory_model.mean_error, self.longest_sequence, self.config.step_tokens,
                             self.config.max_jobs, memory_in_use(self.base.device))

    # -- the loop -------------------------------------------------------------------------------------
    def run_once(self, idle_wait: float = 0.2) -> StepReport | None:
        """Apply the verdicts that are due and pending commands, run one fused step if any job has data,
        end the jobs that are done. Verdicts first: a job whose stop is due stops even when a pause for it
        arrived at the same step boundary, as it would have without the pause. The background uploads that
        ended meanwhile are taken first (events, the next upload, the leaving jobs' ends)."""
        self._collect_uploads()
        self._apply_decisions()
        self._apply_commands()
        ready = []
        deadline = time.monotonic() + self.config.data_grace_s
        for active in list(self.active.values()):
            try:
                if self._data_arrived(active, deadline) and active.job.peek() is not None:
                    ready.append(active.job)
            except JobLinkLost as error:   # its job actor died: the job itself is intact
                self._give_back(active, f"its job actor was lost ({error})")
            except Exception as error:  # noqa: BLE001 - the job's data link broke: that job fails
                self._finish(active, "failed", f"could not get the job's data: {error!r}")
        report = None
        if ready:
            waits_before = sum(a.feed.waits for a in self.active.values())
            chosen = self.trainer.compose(ready, fits=self._fits_budget)
            shape = self._shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
            predicted = self.memory_model.predict(shape)
            try:
                report = self.trainer.run_step(chosen, measure=self._measure_this_step())
            except Exception as error:  # the step failed (e.g. out of memory): its jobs fail
                log.exception("trainer %s: fused step failed", self.trainer_id)
                for job, _ in chosen:
                    self._finish(self.active[job.name], "failed", f"fused step failed: {error!r}")
                self._publish_jobs()
                return None
            self.data_waits += sum(a.feed.waits for a in self.active.values()) - waits_before
            if report.memory_measured:   # the model learns from the allocator's counts only
                self.measured_steps += 1
                self.under_predictions.append((report.peak_memory_bytes - predicted) / report.peak_memory_bytes)
                self.memory_model.observe(shape, report.peak_memory_bytes, predicted)
            self._after_step(report, predicted, shape.adapter_parameters)
        for active in list(self.active.values()):
            if active.job.done:
                self._finish(active, "completed", f"trained {active.job.step} of {active.job.total_steps} steps")
        self._publish_jobs()
        if report is None:
            self.wake.wait(idle_wait)
            self.wake.clear()
        return report

    def _data_arrived(self, active: ActiveJob, deadline: float) -> bool:
        """Whether the job's next micro-batch is here. A job whose data is late is waited for until
        `deadline` (shared by all jobs of this step) the first time, then left out of the steps without
        waiting; after `data_timeout_s` it is given back to the scheduler (checkpointed first)."""
        job = active.job
        if job.pending is not None or job.done:
            return True
        now = time.monotonic()
        wait = 0.0 if active.stalled_since is not None else max(deadline - now, 0.0)
        verdicts_here = self._verdicts_due_here(active, wait)
        if self.active.get(active.assignment.job_id) is not active:
            return False   # a verdict just stopped it (or its job actor was lost)
        if verdicts_here and active.feed.ready(
                0.0 if active.stalled_since is not None else max(deadline - time.monotonic(), 0.0)):
            if active.stalled_since is not None:
                log.info("trainer %s: job %s: its data arrived again after %.1fs", self.trainer_id,
                         active.assignment.job_id, now - active.stalled_since)
            active.stalled_since = None
            return True
        if active.stalled_since is None:
            active.stalled_since = now
            log.warning("trainer %s: job %s: its data or stop verdict is late (waited up to %gs); its steps wait, "
                        "the other jobs go on", self.trainer_id, active.assignment.job_id, self.config.data_grace_s)
        elif now - active.stalled_since >= self.config.data_timeout_s:
            self._give_back(active, f"its data did not arrive for {now - active.stalled_since:.0f}s "
                                    f"(data_timeout_s={self.config.data_timeout_s:g}; its job actor hung?)")
        return False

    def _verdicts_due_here(self, active: ActiveJob, timeout: float) -> bool:
        """Whether the verdicts the job's next step must follow (`VERDICT_LAG`) are here (waiting up to
        `timeout`); applied at once when they are, so that a stop ends the job before that step."""
        due_through = active.job.step + 1 - VERDICT_LAG
        due = [pending for step, pending in active.decisions if step <= due_through]
        if not all(wait_for(pending, timeout) for pending in due):
            return False
        if due:
            self._apply_job_decisions(active)
        return True

    def _give_back(self, active: ActiveJob, reason: str) -> None:
        """Checkpoint a job whose link to its data failed and hand it back to the scheduler, which starts
        it again with a new job actor (or fails it after a few such tries)."""
        log.warning("trainer %s: job %s: %s; checkpointing it and giving it back", self.trainer_id,
                    active.assignment.job_id, reason)
        self._finish(active, "paused", reason, retry=True)

    # -- commands ---------------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        waiting, self.waiting_starts = self.waiting_starts, []
        for assignment in waiting:   # back in `waiting_starts` while its job still leaves
            self._start(assignment)
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "assign":
                for assignment in command[1]:
                    self._start(assignment)
            elif command[0] == "stop":
                _, job_id, kind, reason = command
                active = self.active.get(job_id)
                if active is not None:
                    self._finish(active, kind, reason)

    def _start(self, assignment: Assignment) -> None:
        job_id = assignment.job_id
        if job_id in self.leaving:   # its end waits for its upload (bounded): it starts again after that
            log.info("trainer %s: job %s starts once its last upload here ended", self.trainer_id, job_id)
            self.waiting_starts.append(assignment)
            return
        if job_id in self.active:
            log.warning("trainer %s: job %s is already running here; ignoring the second assignment",
                        self.trainer_id, job_id)
            return
        submission = assignment.submission
        spec = submission.job.model_copy(update={"name": job_id})
        feed = MicroBatchFeed(assignment.link.fetch, assignment.data.start, prefetch=self.config.prefetch)
        remote = None
        local_dir = Path(assignment.output_dir)
        if is_uri(assignment.output_dir):
            local_dir = self.staging_dir / job_id
            remove_snapshots(local_dir)   # an earlier trainer's, left by a crash mid-upload
        files = JobFiles(job_id, local_dir)
        job = None
        note = ""
        try:
            if is_uri(assignment.output_dir):
                remote = StorageLocation(str(assignment.output_dir))
                remote.check_writable()
            job = TrainingJob.attach(spec, self.base, feed, assignment.eval_examples, assignment.data.total_steps,
                                     seed=submission.seed)
            folder = local_dir / CHECKPOINT_FOLDER
            resumed_from = None
            resume_verdict = None
            fetch_note = self._fetch_checkpoint(remote, folder, job_id) if remote is not None else ""
            if has_checkpoint(folder):
                resumed_from, note = self._resume(job, folder, job_id)
                if resumed_from is not None:   # the job's loss history as of its checkpoint, and its verdict
                    resume_verdict = assignment.link.update(JobUpdate(
                        resumed_from=resumed_from, steps=[r.as_row() for r in job.history], evals=list(job.evals)))
            try:
                files.start([record.as_row() for record in job.history])
            except OSError as error:
                raise OSError(f"cannot write its files in {assignment.output_dir}: {error}; make the folder "
                              "writable (or free space there) and resume the job") from error
            feed.prime()
            self.trainer.add_job(job)
        except Exception as error:  # a job that cannot start fails alone
            log.exception("trainer %s: job %s could not start", self.trainer_id, job_id)
            if job is not None:
                remove_adapter(self.base.model, job_id)
            files.close()
            self._emit("failed", job_id, 0, reason=f"could not start: {error}")
            return
        note = "; ".join(part for part in (fetch_note, note) if part)
        active = ActiveJob(assignment, job, feed, files, local_dir, remote)
        active.tracker = self._start_tracker(assignment, local_dir, resumed_from)
        if resume_verdict is not None:
            # the stop decisions of its last steps before the checkpoint, made again from the restored history
            # (a pause may have cut them off): due like step k - 1's verdict; a stop decided at step k waits
            # for its own turn (`_apply_job_decisions`), so the job stops where an unpaused one does
            active.decisions.append((job.step - 1, resume_verdict))
        self.active[job_id] = active
        history = [record.as_row() for record in job.history] if resumed_from is not None else []
        evals = [[step, loss] for step, loss in job.evals] if resumed_from is not None else []
        self._emit("started", job_id, job.step, resumed_from=resumed_from, total_steps=job.total_steps,
                   trainer=self.trainer_id, history=history, evals=evals, tokens=job.tokens_seen,
                   checkpoint_note=note)

    def _fetch_checkpoint(self, remote: StorageLocation, folder: Path, job_id: str) -> str:
        """Put the job's newest checkpoint in its node-local `folder`: the URI's latest complete upload, unless
        this node holds a newer one (uploads that failed; the folder is the job's own, by its unique id).
        Returns a note for the job's reason; raises StorageError when the URI cannot be read (the job does not
        start rather than start over)."""
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
        except CorruptCheckpoint as error:
            if local is not None:
                return f"its uploaded checkpoint is unusable ({error}); resumed from this node's copy"
            return f"its uploaded checkpoint is unusable, started over: {error}"
        return ""

    def _upload_checkpoint(self, active: ActiveJob) -> None:
        """Hand the job's newest checkpoint (and its metrics) to the background uploads as a snapshot; the
        result is taken by `_collect_uploads`. A snapshot that cannot be made is a failed upload."""
        remote, step = active.remote, active.checkpoint_step   # steps may have run since it was saved
        assert remote is not None
        active.upload_due = False
        active.upload_step = step
        try:
            snapshot = snapshot_checkpoint(active.local_dir, active.checkpoint_dir, active.local_dir / METRICS_NAME)
        except OSError as error:
            failed: Future = Future()
            failed.set_exception(error)
            active.upload = failed
            return

        def upload() -> dict[str, Any]:
            try:
                if (snapshot / METRICS_NAME).is_file():
                    remote.upload_file(snapshot / METRICS_NAME, METRICS_NAME)
                return upload_checkpoint(remote, snapshot / CHECKPOINT_FOLDER, step,
                                         go_on=lambda: self._uploads_go_on(active))
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

        active.upload = self.uploads.submit(active.assignment.job_id, upload)
        active.upload.add_done_callback(lambda _: self.wake.set())

    def _uploads_go_on(self, active: ActiveJob) -> bool:
        """Whether the job's upload may still move its pointer: not once its trainer or the job gave up on it
        (it may be resuming elsewhere meanwhile)."""
        return not self.closing.is_set() and not active.abandoned.is_set()

    def _collect_uploads(self) -> None:
        """Take the background uploads that ended: a periodic checkpoint's event (and the next upload, where a
        newer checkpoint waits), a leaving job's end; a leaving job past its deadline fails."""
        for active in [*self.active.values(), *(leaving.active for leaving in self.leaving.values())]:
            if active.upload is not None and active.upload.done():
                self._uploaded(active)
        now = time.monotonic()
        for job_id, leaving in list(self.leaving.items()):
            active, remote = leaving.active, leaving.active.remote
            assert remote is not None
            if leaving.upload.done() and active.upload is None:
                error = leaving.upload.exception()
                if error is None:
                    if leaving.kind in ("completed", "stopped_early"):
                        leaving.data["adapter_dir"] = remote.uri
                    self._report_end(active, leaving.kind, leaving.data)
                else:
                    log.warning("trainer %s: job %s: uploading its results to %s failed: %s", self.trainer_id,
                                job_id, remote.uri, error)
                    self._report_upload_failed(leaving, f"uploading its results to {remote.uri} failed "
                                                        f"{FINAL_WRITE_ATTEMPTS} times: {error}")
            elif now >= leaving.deadline:
                active.abandoned.set()   # should it end after all, it moves no pointer
                self._report_upload_failed(leaving, f"uploading its results to {remote.uri} did not end within "
                                                    f"{self.config.upload_timeout_s:g}s (upload_timeout_s)")
            else:
                continue
            del self.leaving[job_id]
        self._publish_jobs()

    def _uploaded(self, active: ActiveJob) -> None:
        """A periodic checkpoint's upload ended: its `checkpoint` event; a newer checkpoint's upload next."""
        upload, step, job_id, remote = active.upload, active.upload_step, active.assignment.job_id, active.remote
        assert upload is not None and remote is not None
        active.upload = None
        error = upload.exception()
        if error is not None:   # the local checkpoint stays; the next checkpoint uploads again
            active.upload_error = (f"uploading its checkpoint at step {step} to {remote.uri} failed ({error}); it is "
                                   f"kept on {self.trainer_id} and uploaded again at the next checkpoint")
            log.warning("trainer %s: job %s: %s", self.trainer_id, job_id, active.upload_error)
            self._emit("checkpoint", job_id, step, upload_error=active.upload_error)
        else:
            recovered = active.upload_error is not None
            active.upload_error = None
            self._emit("checkpoint", job_id, step, uploaded=remote.uri, upload_recovered=recovered)
        if active.upload_due and self.active.get(job_id) is active:
            self._upload_checkpoint(active)

    def _leave(self, active: ActiveJob, kind: str, data: dict[str, Any]) -> None:
        """Upload a leaving job's results in the background (after its periodic upload, if one runs); its end
        is reported when that is done (`_collect_uploads`)."""
        remote, local_dir, step = active.remote, active.local_dir, active.job.step
        assert remote is not None
        outputs = kind in ("completed", "stopped_early")
        leaving = LeavingJob(active, kind, data, Future(), time.monotonic() + self.config.upload_timeout_s)

        def go_on() -> bool:
            return self._uploads_go_on(active)

        def upload() -> None:
            for attempt in range(FINAL_WRITE_ATTEMPTS):
                try:
                    return upload_results(remote, local_dir, step, outputs, go_on)
                except OSError as error:
                    if attempt + 1 == FINAL_WRITE_ATTEMPTS or not go_on():
                        raise
                    log.warning("trainer %s: job %s: uploading its results to %s failed (%d of %d attempts): %s",
                                self.trainer_id, active.assignment.job_id, remote.uri, attempt + 1,
                                FINAL_WRITE_ATTEMPTS, error)
                    time.sleep(FINAL_WRITE_BACKOFF_S[min(attempt, len(FINAL_WRITE_BACKOFF_S) - 1)])

        leaving.upload = self.uploads.submit(active.assignment.job_id, upload)
        leaving.upload.add_done_callback(lambda _: self.wake.set())
        self.leaving[active.assignment.job_id] = leaving

    def _report_upload_failed(self, leaving: LeavingJob, why: str) -> None:
        data = leaving.data
        data["reason"] = (f"{data['reason']}; then {why}; its checkpoint at step {data.get('checkpoint_step')} is "
                          f"kept on {self.trainer_id}'s node: make the store reachable, then resume the job")
        data.pop("retry", None)
        self._report_end(leaving.active, "failed", data)

    def _resume(self, job: TrainingJob, folder: Path, job_id: str) -> tuple[int | None, str]:
        """Restore the job from its newest valid checkpoint: (its step, a note on what was skipped), or
        (0, why) when none is valid (the job starts over, and says so)."""
        try:
            loaded = load_checkpoint(job, folder)
        except CheckpointError as error:
            log.error("trainer %s: job %s: no usable checkpoint, it starts over: %s", self.trainer_id, job_id, error)
            return 0, f"no usable checkpoint, started over: {error}"
        note = ""
        if loaded.skipped:
            note = f"resumed from the previous checkpoint; skipped: {'; '.join(loaded.skipped)}"
            log.warning("trainer %s: job %s: %s", self.trainer_id, job_id, note)
        return job.step, note

    def _apply_decisions(self) -> None:
        for active in list(self.active.values()):
            self._apply_job_decisions(active)

    def _apply_job_decisions(self, active: ActiveJob) -> None:
        """Apply the job's verdicts that are due (`VERDICT_LAG`) and here, in step order; a stop ends it."""
        due_through = active.job.step + 1 - VERDICT_LAG
        keep = []
        for step, pending in active.decisions:
            if step > due_through or keep or not pending.done():
                keep.append((step, pending))   # not due yet, or behind one that is not here
                continue
            try:
                verdict = pending.result()
            except JobLinkLost as error:   # its job actor died: its stop rule and data with it
                self._give_back(active, f"its job actor was lost ({error})")
                return
            except Exception as error:  # noqa: BLE001 - losing a job's history must not stop training
                log.warning("trainer %s: job %s: its loss update was lost: %r", self.trainer_id,
                            active.assignment.job_id, error)
                continue
            if verdict.stop is not None and verdict.stop.step > step:
                keep.append((verdict.stop.step, Done(verdict)))   # a resumed job's stop for a later step
                continue
            if verdict.predicted_stop_step is not None:
                self._emit("prediction", active.assignment.job_id, active.job.step,
                           predicted_stop_step=verdict.predicted_stop_step)
            if verdict.stop is not None:
                self._finish(active, "stopped_early", verdict.stop.reason)
                return
        active.decisions = keep

    # -- after a step -----------------------------------------------------------------------------------
    def _measure_this_step(self) -> bool:
        """On CPU the allocator is counted (torch.profiler, slower) on the first steps and every
        MEASURE_EVERY-th step after; on CUDA every step is counted anyway (no cost)."""
        step = self.trainer.step_count
        return self.measured_steps < MEASURE_FIRST or step % MEASURE_EVERY == 0

    def _shape(self, micro_batches: list[JobMicroBatch]) -> StepShape:
        lengths = [len(e) for mb in micro_batches for e in mb.rows]
        parameters = sum(p.numel() for job in self.trainer.jobs.values() for p in job.adapter.parameters())
        longest = max(lengths)
        parts = [(self.trainer.jobs[mb.job].spec.lora, mb.padded_tokens(self.trainer.layout, longest), mb.examples)
                 for mb in micro_batches]
        return StepShape.of(lengths, parameters, tokens=self.trainer.step_cost(micro_batches),
                            analytic_bytes=self.memory_prior.analytic_bytes(parts))

    def _fits_budget(self, micro_batches: list[JobMicroBatch]) -> bool:
        """Whether a step's predicted peak, raised by the margin its predictions have needed, fits the budget."""
        return self.memory_model.predict(self._shape(micro_batches)) * (1 + self.memory_margin) <= self.budget

    @property
    def memory_margin(self) -> float:
        """MEMORY_MARGIN, or the largest share by which a measured peak has exceeded its prediction."""
        return max([MEMORY_MARGIN, *self.under_predictions])

    def _after_step(self, report: StepReport, predicted: int, adapter_parameters: int) -> None:
        self.busy_seconds += report.seconds
        self.tokens += report.tokens
        self.padding_tokens += report.padding_tokens
        self.peak_memory = max(self.peak_memory, report.peak_memory_bytes)
        self.longest_sequence = max([self.longest_sequence, *report.sequence_lengths])
        row = {"trainer": self.trainer_id, "time": round(time.time(), 3), **report.as_row(),
               "predicted_memory_bytes": predicted, "adapter_parameters": adapter_parameters,
               "sequence_lengths": report.sequence_lengths}
        self._write_step_log(row)
        self._emit("step", "", report.step, **row)
        now = time.time()
        for result in report.results:
            active = self.active[result.job]
            record = result.optimizer_step
            if record is None:
                continue
            job = active.job
            update = JobUpdate(steps=[record.as_row()])
            active.files.append(record.as_row())
            seconds = max(now - active.last_step_time, 1e-9)
            active.last_step_time = now
            self._emit("progress", result.job, record.step, **record.as_row(), tokens_per_s=record.tokens / seconds,
                       total_steps=job.total_steps)
            if active.tracker is not None:
                active.tracker.step(record.as_row(), record.tokens / seconds)
            spec = job.spec
            if job.eval_examples and spec.eval_every and record.step % spec.eval_every == 0:
                eval_loss = self.trainer.evaluate(job)
                job.evals.append((record.step, eval_loss))   # checkpointed: a resumed job's stop rule sees it
                active.last_eval_step = record.step
                update.evals.append((record.step, eval_loss))
                self._emit("eval", result.job, record.step, eval_loss=eval_loss)
                if active.tracker is not None:
                    active.tracker.eval(record.step, eval_loss)
            if self._checkpoint_due(active, record.step) and not job.done:
                self._checkpoint(active)
            active.decisions.append((record.step, active.assignment.link.update(update)))
            if active.files.failed:
                self._finish(active, "failed", active.files.failed)

    def _checkpoint_due(self, active: ActiveJob, step: int) -> bool:
        every_s = active.job.spec.checkpoint_every_s
        return (step % active.job.spec.checkpoint_every == 0
                or (every_s is not None and time.monotonic() - active.last_checkpoint >= every_s))

    def _checkpoint(self, active: ActiveJob) -> None:
        """A periodic checkpoint; a failed write is counted against the job's folder and tried again at its
        next step (the previous checkpoint stays in place meanwhile)."""
        job = active.job
        try:
            save_checkpoint(job, active.checkpoint_dir, self.base_identity.serving_id)
        except OSError as error:
            active.files.failed_write(error, CHECKPOINT_FOLDER)
            return
        active.files.succeeded(CHECKPOINT_FOLDER)
        active.last_checkpoint = time.monotonic()
        active.checkpoint_step = job.step
        if active.remote is None:
            self._emit("checkpoint", active.assignment.job_id, job.step)
            return
        if active.upload is None:   # uploaded in the background; its event when that ends (`_uploaded`)
            self._upload_checkpoint(active)
        else:                       # the previous one still uploads: the newest checkpoint goes after it
            active.upload_due = True

    def _write_step_log(self, row: dict[str, Any]) -> None:
        """The trainer's own step row (for reports); a disk that refuses it costs the row, never a job."""
        try:
            self.step_log.write(json.dumps(row) + "\n")
            self.step_log.flush()
        except OSError as error:
            if not self.step_log_failing:
                log.warning("trainer %s: cannot write its step log %s (%s); training goes on, rows are lost "
                            "until it can", self.trainer_id, self.step_log_path, error)
            self.step_log_failing = True
            return
        self.step_log_failing = False

    def _finish(self, active: ActiveJob, kind: str, reason: str, *, retry: bool = False) -> None:
        """Take a job off the trainer: checkpoint it (unless it failed), write its adapter when it is
        done, and report how it ended. `retry`: a `paused` job the scheduler should start again."""
        job, job_id = active.job, active.assignment.job_id
        data: dict[str, Any] = {"reason": reason, "tokens": job.tokens_seen}
        if retry:
            data["retry"] = True
        try:
            if kind in ("completed", "stopped_early"):
                if job.eval_examples and active.last_eval_step != job.step:
                    data["eval_loss"] = self.trainer.evaluate(job)
                    job.evals.append((job.step, data["eval_loss"]))
                    active.assignment.link.update(JobUpdate(evals=[(job.step, data["eval_loss"])]))
                    if active.tracker is not None:
                        active.tracker.eval(job.step, data["eval_loss"])
                metadata = {"base_model": self.base_identity.metadata, "job_id": job_id, "step": job.step}
                data["adapter_dir"] = str(self._write(active, "its adapter", lambda: save_adapter(
                    job.adapter, active.local_dir, self.base_identity.serving_id, metadata)))
            if kind != "failed":
                self._write(active, "its checkpoint", lambda: save_checkpoint(
                    job, active.checkpoint_dir, self.base_identity.serving_id))
                data["checkpoint_step"] = job.step
        except OSError as error:   # the folder refused every try: one clear reason, no false success
            kind, data["reason"] = "failed", (f"{reason}; then writing its results in {active.assignment.output_dir} "
                                              f"failed {FINAL_WRITE_ATTEMPTS} times: {error}; free space there or "
                                              "make it writable, then resume the job")
            data.pop("retry", None)
        except Exception as error:  # writing failed: report it rather than a false success
            log.exception("trainer %s: job %s: writing its results failed", self.trainer_id, job_id)
            kind, data["reason"] = "failed", f"{reason}; then writing its results failed: {error!r}"
            data.pop("retry", None)
        finally:
            del self.active[job_id]
            active.files.close()
            self.trainer.remove_job(job.name)
        if active.remote is not None and kind != "failed":   # reported when its results are uploaded
            self._leave(active, kind, data)
            return
        self._report_end(active, kind, data)

    def _report_end(self, active: ActiveJob, kind: str, data: dict[str, Any]) -> None:
        """Report how a job ended (its tracking finished first, its problems added to its reason)."""
        job, job_id = active.job, active.assignment.job_id
        if active.tracker is not None:
            adapter_written = kind in ("completed", "stopped_early")
            active.tracker.finish(kind, job.step, active.local_dir if adapter_written else None)
            if active.tracker.problems:   # known by now: the job's reason says so
                data["reason"] = f"{data['reason']}; {'; '.join(active.tracker.problems)}"
        self._emit(kind, job_id, job.step, **data)

    @staticmethod
    def _write(active: ActiveJob, what: str, write: Any) -> Any:
        """`write()` with a few tries (a full disk may free up); the last OSError is raised."""
        for attempt in range(FINAL_WRITE_ATTEMPTS):
            try:
                return write()
            except OSError as error:
                active.files.failed_write(error, what)
                if attempt + 1 == FINAL_WRITE_ATTEMPTS:
                    raise
                time.sleep(FINAL_WRITE_BACKOFF_S[min(attempt, len(FINAL_WRITE_BACKOFF_S) - 1)])
        raise AssertionError("unreachable")

    def _emit(self, kind: str, job_id: str, step: int, /, **data: Any) -> None:
        with self.lock:
            self.events.append(TrainerEvent(kind, job_id, step, data))  # type: ignore[arg-type]

    def _publish_jobs(self) -> None:
        self.job_ids = list(self.active) + [job_id for job_id in self.leaving if job_id not in self.active]

    def _start_tracker(self, assignment: Assignment, local_dir: Path, resumed_from: int | None) -> JobTracker | None:
        """The job's tracking (actors/service/tracking.py), or None; never raises (tracking never stops a job)."""
        try:
            tracker = start_tracker(assignment.job_id, assignment.submission, local_dir,
                                    str(assignment.output_dir) if is_uri(assignment.output_dir) else None,
                                    resumed_from)
        except Exception:  # e.g. no thread could be started: the job trains without tracking
            log.exception("trainer %s: job %s: its tracking could not start; it trains without it", self.trainer_id,
                          assignment.job_id)
            return None
        if tracker is not None:
            self.trackers = [t for t in self.trackers if not t.done.is_set()] + [tracker]
        return tracker

    def close(self) -> None:
        for active in list(self.active.values()):
            self._finish(active, "paused", "the trainer is shutting down")
        self._wait_for_uploads(min(self.config.upload_timeout_s, CLOSE_UPLOAD_WAIT_S))
        deadline = time.monotonic() + CLOSE_WAIT_S
        for tracker in self.trackers:   # the last metrics and artefacts of the jobs that just left
            if not tracker.wait(max(deadline - time.monotonic(), 0.0)):
                log.warning("trainer %s: job %s: its tracking did not finish writing within %.0fs; its last metrics "
                            "or its adapter artefact may be missing there", self.trainer_id, tracker.job_id,
                            CLOSE_WAIT_S)
        self.step_log.close()

    def _wait_for_uploads(self, timeout: float) -> None:
        """Wait up to `timeout` for the leaving jobs' uploads and report their ends; those not done by then
        fail (their uploads write no pointer any more). The uploads are closed."""
        deadline = time.monotonic() + timeout
        while self.leaving and time.monotonic() < deadline:
            self._collect_uploads()
            self.wake.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            self.wake.clear()
        for leaving in self.leaving.values():
            leaving.deadline = min(leaving.deadline, time.monotonic())
        self.closing.set()
        self._collect_uploads()
        self.uploads.close()


def upload_results(remote: StorageLocation, local_dir: Path, step: int, outputs: bool,
                   go_on: Callable[[], bool] | None = None) -> None:
    """Mirror a job's files to its URI: its metrics, with `outputs` every file at the top of its local folder
    (the adapter), then its checkpoint (the pointer last; not written once `go_on()` is False). Raises
    StorageError."""
    for path in sorted(local_dir.iterdir()):
        if path.is_file() and not path.name.startswith(".") and (outputs or path.name == METRICS_NAME):
            remote.upload_file(path, path.name)
    if has_checkpoint(local_dir / CHECKPOINT_FOLDER):
        upload_checkpoint(remote, local_dir / CHECKPOINT_FOLDER, step, go_on=go_on)
