"""`GpuTrainerActor`: one per GPU (or a configured number on CPU). It loads its base model once and runs
fused steps continuously in a background thread over the jobs assigned to it; assignment, stopping and
polling are concurrent calls that take effect at the next step boundary."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import ray
import torch

from actors.core.config import TrainerConfig
from actors.core.events import TrainerEvent, TrainerStatus
from actors.core.job_data import DataSummary
from actors.core.trainer_loop import Assignment, TrainerLoop
from actors.engine.data import Example
from actors.engine.models import load_base_model
from actors.engine.spec import JobSubmission
from actors.ray_links import ActorJobLink

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=8, max_restarts=0)
class GpuTrainerActor:
    def __init__(self, trainer_id: str, config_json: str, state_dir: str, threads: int | None = None):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        config = TrainerConfig.model_validate_json(config_json)
        if threads:
            torch.set_num_threads(threads)
        device = "cuda" if config.num_gpus > 0 else "cpu"
        base = load_base_model(config.base_model, dtype=config.dtype, device=device,
                               quantization=config.quantization)
        self.loop = TrainerLoop(base, config, trainer_id, Path(state_dir))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, args=(self.stopping,),
                                       name=f"{trainer_id}-steps", daemon=True)
        self.thread.start()
        log.info("trainer %s: %s on %s, %d torch threads", trainer_id, config.base_model, base.device,
                 torch.get_num_threads())

    def status(self) -> TrainerStatus:
        return self.loop.status()

    def poll(self) -> tuple[TrainerStatus, list[TrainerEvent]]:
        return self.loop.status(), self.loop.drain_events()

    def assign(self, jobs: list[tuple[str, str, str, DataSummary, list[Example], ray.actor.ActorHandle]]) -> None:
        """Jobs to start, all at the same step boundary: (job id, submission JSON, output folder, data
        summary, eval examples, its JobActor) each."""
        self.loop.assign([Assignment(job_id, JobSubmission.model_validate_json(submission), Path(output_dir),
                                     summary, eval_examples, ActorJobLink(job_actor))
                          for job_id, submission, output_dir, summary, eval_examples, job_actor in jobs])

    def stop_job(self, job_id: str, kind: str, reason: str) -> None:
        self.loop.stop_job(job_id, kind, reason)

    def shutdown(self) -> list[TrainerEvent]:
        """Stop stepping; jobs still here are paused with a checkpoint. Returns the last events."""
        self.stopping.set()
        self.loop.wake.set()
        self.thread.join(timeout=120)
        self.loop.close()
        return self.loop.drain_events()
