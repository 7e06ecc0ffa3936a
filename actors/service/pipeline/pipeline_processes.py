"""A pipeline trainer run as local processes, without Ray: stage 0 (with the head) in this process, every
other stage in a process of its own (on CPU forked from multiprocessing's fork server, which imported the engine
once: `stage_context`), over the same transport a Ray pipeline uses (torch.distributed: gloo between CPU processes, NCCL
between GPUs). `aspen run --in-process` with `stages:` and the tests use it.

Each stage process loads the base itself (`loader`, a picklable callable returning a `BaseModel`), keeps
its own stage (actors/engine/pipeline/stage_model.py) and runs the messages the head sends until told to
stop. A stage that fails prints its error and exits; the head's next exchange with it then fails, and
`LocalPipeline` names the stage and its exit code."""

from __future__ import annotations

import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from actors.engine import lora_grouped
from actors.engine.models import BaseModel
from actors.engine.pipeline.head import PipelineTrainer
from actors.engine.pipeline.stage import StageRuntime
from actors.engine.pipeline.stage_generation import HeldAdapter
from actors.engine.pipeline.stage_messages import REPLYING, StageMessageKind, StageSettings
from actors.engine.pipeline.stage_model import check_stageable, cut_stage
from actors.engine.pipeline.stage_split import balanced_split, check_split, even_split, measure_layer_costs
from actors.engine.pipeline.transport import (
    TAG_COMMAND,
    TAG_REPLY,
    StageLinks,
    open_rendezvous,
    ready_key,
    shared_queues,
)
from actors.engine.recompute import decoder_layers
from actors.engine.warmup import settle_garbage_collector

log = logging.getLogger(__name__)


STARTUP_POLL_S = 0.1   # how often stage 0 looks at the other stages while they start


def dist_errors() -> type[Exception]:
    """torch.distributed's error for a failed exchange (a peer gone): DistBackendError where torch has it."""
    return getattr(torch.distributed, "DistBackendError", RuntimeError)


@dataclass(frozen=True, kw_only=True)
class StageLaunch:
    """What a stage process needs: who it is, where to meet the others, what to load and keep."""

    rank: int
    world: int
    address: str
    port: int
    loader: Callable[[], BaseModel]
    split: tuple[int, ...]
    device: str
    settings: StageSettings
    threads: int | None = None
    timeout_s: float = 600.0
    queues: dict | None = None     # the data channel's queues where the stages share a device (transport.py)


class StageHandle(Protocol):
    """A running stage other than stage 0, as the pipeline watches it: a local process
    (`multiprocessing.Process`), or a Ray stage actor (actors/stage_actors.py)."""

    name: str

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


StageStarter = Callable[["StageLaunch"], StageHandle]


def stage_context(devices: list[str]):
    """Where stage processes start. On CPU devices: forked from multiprocessing's fork server, which imported this
    module (torch, transformers, the engine) once, so that a stage starts in a fraction of a second instead of
    importing them anew (~6 s of CPU a stage on a 2-core machine, every time a pipeline starts or is rebuilt).
    Memory: the stages share the libraries' pages with the server (a 3-stage pipeline of the tiny test model,
    measured 2026-12-06: 614 MB of proportional set size for the server and two stages, against 683 MB for two
    spawned stages; with one other stage the server costs ~0.2 GB more than a spawned stage would).
    Where a stage uses CUDA: spawned, as checked on the H200 leases. A forked child cannot use CUDA once its parent
    initialised it, and the server's imports on a CUDA machine (Triton's and Liger's among them) are not yet checked
    to leave CUDA alone; the import's seconds matter little beside loading a GPU stage's share of the base."""
    if all(torch.device(device).type == "cpu" for device in devices):
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", __name__])
        return context
    return torch.multiprocessing.get_context("spawn")   # its queues pass CUDA tensors by IPC


def stage_main(launch: StageLaunch) -> None:
    """A stage process's whole life (`run_stage`); a failure is printed with its traceback, and the process
    exits non-zero. Ctrl-C is left to the head: a terminal sends it to the whole process group, and the run's own
    process stops the stages between steps (`local_run.StopBetweenSteps`); a stage that died at it lost the
    pipeline, and with it the jobs' last steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_stage(launch)
    except BaseException:  # noqa: BLE001 - printed with its traceback, then the process exits non-zero
        print(f"pipeline stage {launch.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def run_stage(launch: StageLaunch) -> None:
    """Load, cut, meet the others, run the head's messages until `stop`."""
    if launch.threads:
        torch.set_num_threads(launch.threads)
    if launch.settings.lora_grouping is not None:
        lora_grouped.GROUPING = launch.settings.lora_grouping
    if hasattr(launch.loader, "stage"):   # a StageLoader: this stage's tensors only
        model = launch.loader.stage(list(launch.split), launch.rank, launch.device)
    else:
        model = cut_stage(launch.loader(), list(launch.split), launch.rank, torch.device(launch.device))
    links = StageLinks(launch.rank, launch.world, launch.address, launch.port, torch.device(launch.device),
                       launch.timeout_s, launch.queues)
    runtime = StageRuntime(model, links, launch.settings)
    settle_garbage_collector()   # its stage of the base and the libraries out of every later full collection
    while True:
        message = links.recv_object(0, TAG_COMMAND)
        if message[0] == StageMessageKind.STOP:
            break
        reply = runtime.handle(message)
        if message[0] in REPLYING:
            links.send_object(reply, 0, TAG_REPLY)
    runtime.close()


def resolve_split(base: BaseModel, stages: int, split: list[int] | str) -> list[int]:
    """`split`: layer counts per stage, "even", or "measured" (balanced by each layer's measured time and
    memory on this process's device)."""
    layers = len(decoder_layers(base.decoder))
    if isinstance(split, str):
        if split == "even":
            return even_split(layers, stages)
        if split == "measured":
            return balanced_split(measure_layer_costs(base), stages)
        raise ValueError(f"pipeline split '{split}': give layer counts per stage, 'even' or 'measured'")
    return check_split(list(split), layers, stages)


class StageLost(RuntimeError):
    """A stage process ended while the pipeline ran: the pipeline cannot go on; rebuild it and resume the jobs
    from their last states (`PipelineTrainer.job_state`) or checkpoints."""


class LocalPipeline:
    """`with LocalPipeline(loader, 2) as pipeline: pipeline.add_job(...); pipeline.run()`; the trainer's
    calls, with a lost stage reported as `StageLost` naming it. `loader`: a picklable callable returning the
    whole base, which each process loads and cuts; or a `StageLoader`, with which each process reads only
    its stage's tensors (and the head the whole base only for a measured split)."""

    def __init__(self, loader: Callable[[], BaseModel], stages: int, *, split: list[int] | str = "measured",
                 devices: list[str] | None = None, settings: StageSettings | None = None,
                 step_tokens: int = 4096, threads: int | None = None, timeout_s: float = 600.0,
                 transport: str = "distributed", starter: StageStarter | None = None, address: str = "127.0.0.1"):
        """`transport`: "distributed" (torch.distributed point-to-point: NCCL between GPUs, gloo on CPU) or
        "shared" (torch.multiprocessing queues: CUDA IPC for stages sharing one GPU, shared memory on CPU).
        `starter`: starts each other stage (default: a process of this one's); `address`: where they meet
        stage 0 (this machine's address that the other stages reach)."""
        if stages < 2:
            raise ValueError(f"a pipeline trainer has 2 or more stages, not {stages} (stages: 1 is the "
                             "single-device trainer)")
        settings = settings or StageSettings()
        devices = devices or ["cpu"] * stages
        if len(devices) != stages:
            raise ValueError(f"{len(devices)} devices for {stages} pipeline stages: give one device per stage")
        self.threads_before = torch.get_num_threads()
        self.grouping_before = lora_grouped.GROUPING
        if settings.lora_grouping is not None:
            lora_grouped.GROUPING = settings.lora_grouping
        if threads:
            torch.set_num_threads(threads)   # stage 0 runs here: as many threads as each other stage
        base = None
        if hasattr(loader, "stage") and split != "measured":   # a StageLoader: no process reads the whole base
            layers = loader.layers()
            self.split = even_split(layers, stages) if split == "even" else check_split(list(split), layers, stages)
        else:
            base = loader()
            check_stageable(base)
            self.split = resolve_split(base, stages, split)
        context = stage_context(devices)
        if transport not in ("distributed", "shared"):
            raise ValueError(f"pipeline transport '{transport}': 'distributed' or 'shared'")
        if transport == "shared" and starter is not None:
            raise ValueError("pipeline transport 'shared' passes tensors between processes of this one: it takes no "
                             "other stage starter")
        queues = shared_queues(context, stages) if transport == "shared" else None

        def start_process(launch: StageLaunch) -> StageHandle:
            process = context.Process(target=stage_main, args=(launch,), name=f"aspen-stage-{launch.rank}",
                                      daemon=True)
            process.start()
            return process

        self.processes: list[StageHandle] = []
        store = open_rendezvous(stages, timeout_s)
        try:
            for rank in range(1, stages):
                launch = StageLaunch(rank=rank, world=stages, address=address, port=store.port, loader=loader,
                                     split=tuple(self.split), device=devices[rank], settings=settings,
                                     threads=threads, timeout_s=timeout_s, queues=queues)
                self.processes.append((starter or start_process)(launch))
            model = (loader.stage(self.split, 0, devices[0]) if base is None
                     else cut_stage(base, self.split, 0, torch.device(devices[0])))
            self._await_stages(store, timeout_s)
            self.links = StageLinks(0, stages, address, store.port, torch.device(devices[0]), timeout_s, queues,
                                    store=store)
        except BaseException:
            self._stop_processes(kill=True)
            del store   # closed now, not whenever the garbage collector reaches the traceback that holds this frame
            raise
        self.trainer = PipelineTrainer(StageRuntime(model, self.links, settings), self.links, step_tokens=step_tokens)

    def _await_stages(self, store, timeout_s: float) -> None:
        """Until every other stage has loaded its share of the base and reached the rendezvous: StageLost
        naming a stage that ended meanwhile (it could not be placed, load or start), TimeoutError naming those
        still missing after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        waiting = list(range(1, len(self.processes) + 1))
        while True:
            waiting = [rank for rank in waiting if not store.check([ready_key(rank)])]
            if not waiting:
                return
            codes = {rank: self.processes[rank - 1].exitcode for rank in waiting}   # a Ray stage's logs its error
            ended = [f"stage {rank} ({self.processes[rank - 1].name}, exit code {code})"
                     for rank, code in codes.items() if code is not None]
            if ended:
                raise StageLost(f"pipeline stage ended while starting: {', '.join(ended)}; its log has the error")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline stages {waiting} did not load their layers and meet stage 0 within "
                                   f"{timeout_s:.0f} s: still waiting for resources, or still loading; see their "
                                   "logs")
            time.sleep(STARTUP_POLL_S)

    # -- the trainer's calls, a lost stage named --------------------------------------------------------
    def _guarded(self, call: Callable, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except (RuntimeError, dist_errors()) as error:
            for process in self.processes:
                process.join(timeout=5 if process.exitcode is None else 0)
            lost = self.failed_stages() or [f"stage {rank}" for rank, process in enumerate(self.processes, start=1)
                                            if not process.is_alive()]
            if not lost:
                raise
            raise StageLost(f"pipeline stage lost: {', '.join(lost)} ({error}); the pipeline cannot go on: close "
                            "it, start a new one and resume its jobs from their last states") from error

    def add_job(self, *args, **kwargs) -> None:
        self._guarded(self.trainer.add_job, *args, **kwargs)

    def run(self, *args, **kwargs):
        return self._guarded(self.trainer.run, *args, **kwargs)

    def job_state(self, name: str) -> dict:
        return self._guarded(self.trainer.job_state, name)

    def remove_job(self, name: str) -> dict:
        return self._guarded(self.trainer.remove_job, name)

    def stats(self) -> list[dict]:
        return self._guarded(self.trainer.stats)

    def evaluate(self, name: str, examples: list | None = None, batch_size: int = 8) -> float:
        return self._guarded(self.trainer.evaluate, name, examples, batch_size)

    def generate(self, requests: list, choose: Callable, finished: Callable) -> None:
        """`generate.decode` over the stages (actors/engine/pipeline/stage_generation.py)."""
        self._guarded(self.trainer.generate, requests, choose, finished)

    def hold(self, request: HeldAdapter) -> list:
        """Every stage adds, fills or drops an adapter held for decoding calls (stage_generation.py); adding
        answers each stage's share of its tensors, stage 0's first."""
        return self._guarded(self.trainer.ask, (StageMessageKind.HOLD, request))

    def memory(self) -> list:
        """Each stage's memory model (`StageMemory`), stage 0's first."""
        return self._guarded(self.trainer.ask, (StageMessageKind.MEMORY,))

    def measure(self, on: bool) -> list:
        """Open (`on`) each stage's allocator window, or close it: each stage's peak bytes meanwhile."""
        return self._guarded(self.trainer.ask, (StageMessageKind.MEASURE, on))

    def failed_stages(self) -> list[str]:
        return [f"stage {rank} (exit code {process.exitcode})"
                for rank, process in enumerate(self.processes, start=1) if process.exitcode not in (None, 0)]

    def _stop_processes(self, *, kill: bool = False) -> None:
        for process in self.processes:
            if kill:
                process.kill()
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=30)

    def close(self, *, failed: bool = False) -> None:
        """Stop every stage: told to, or (`failed`, or a stage already gone) killed."""
        failed = failed or not all(process.is_alive() for process in self.processes)
        try:
            if not failed:
                self.trainer.close()
        finally:
            if failed:
                for process in self.processes:
                    process.kill()
            self._stop_processes()
            self.trainer.runtime.close(flush=not failed)
            torch.set_num_threads(self.threads_before)
            lora_grouped.GROUPING = self.grouping_before
        if not failed:   # stopped when told to: each ended cleanly, or something of it crashed on the way out
            crashed = [f"stage {rank} (exit code {process.exitcode})"
                       for rank, process in enumerate(self.processes, start=1) if process.exitcode not in (0, None)]
            if crashed:
                log.warning("pipeline stages ended with an error after being told to stop: %s", ", ".join(crashed))

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, kind, value, trace) -> None:
        self.close(failed=kind is not None)
