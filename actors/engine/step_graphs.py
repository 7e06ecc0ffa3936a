"""`compile: graphs`: each fused step's forward, loss and backward captured once as a CUDA graph and replayed, for
steps the host bounds (a small base on a large GPU: smollm2's step launches ~1,400 kernels for ~10 ms of GPU work,
so the host's launches are the step; bench/gpu_cost_model.py --graphed).

A replay runs the captured kernels with the captured shapes, host numbers and addresses, and none of the Python
that launched them. So a graphed step is one of a fixed shape (actors/engine/fixed_shapes.py: each job's tokens in a
segment of fixed capacity, the sequences' bounds a device buffer), its inputs copied into static device buffers
before each replay (one copy from pinned memory), and what the step's Python does besides launching kernels is
done by this module around the replay: each job's gradient views attached (`GradientBuffer.attach`, which a
replay does not repeat) before it. Work an eager step does only where something changed is all captured (the jobs'
compute-dtype copies and the layers' kept stacks of them refreshed: `lora_masters.every_refresh`), so that a graph
captured after a step that only accumulated gradients still refreshes them at every replay. The optimizers'
updates, the read-back and the next step's packing stay eager, after the replay, as in an eager step.

A shape's first steps run eagerly (`WARMUP` of them, and until the LoRA path's kernel measurements of the shapes
its step calls have chosen: actors/engine/kernel_tuning.py), then one is captured and replayed; a job set whose
micro-batches outgrow its shape gets a larger one (a capture of its own; at most `KEPT` graphs are kept, each holding
its step's activations in a memory pool of its own). A step of another job set drops the graphs (the stacked weights
and tables they read are its jobs'), and a graph whose jobs' buffers moved (masters, casts, gradients made anew), or
whose layers' kept stacks were replaced or layers rewrapped, is captured again: a replay never reads or writes memory
its capture did not. A capture that fails (an operation that cannot be captured, such
as a host read inside the step) leaves that shape eager, with the reason logged once: the step's numbers are the
eager step's either way.

What takes this path (`refusal` says why a step does not): a CUDA device, supervised (sft) jobs without dropout, in
bfloat16 or float32, a packed layout, no recomputation, no interactive calls, no float16 loss scale; another step
runs eagerly. The jobs' numbers agree with the eager packed step to rounding (the padded segments may block the
products differently), not bit for bit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from actors.engine import kernel_tuning, lora_stacks
from actors.engine.adapter_surgery import surgeries
from actors.engine.fixed_shapes import (
    Ceilings,
    FixedBatch,
    FixedShape,
    counts_of,
    fixed_batch,
    fixed_layout,
    shape_for,
    split_parts,
)
from actors.engine.layout import StepLayout
from actors.engine.lora_masters import MasterPool, every_refresh
from actors.engine.packing import FusedBatch
from actors.engine.step_objective import StepObjective

log = logging.getLogger(__name__)

WARMUP = 2          # eager steps of a shape before its capture (the kernels' first calls compile and check)
MAX_WARMUP = 40     # a shape whose kernel measurements have not settled by then stays eager (a capture would time
                    # the candidates inside the graph)
KEPT = 2            # graphs kept at once (each holds a step's activations)


class GraphBackend(Protocol):
    """How a step is captured and replayed: CUDA graphs (`CudaGraphs`), or in the CPU tests a stand-in that replays
    the recorded operations (tests/helpers/graph_replay.py)."""

    def warm(self, run: Callable[[], Any]) -> Any:
        """Run an eager warm-up step as the capture will (CUDA: on the capture's stream)."""

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        """Capture `run` (its kernels not executed): (the graph, what `run` returned)."""

    def replay(self, graph: Any) -> None: ...


class CudaGraphs:
    """torch.cuda.CUDAGraph, captured on a side stream of its own (warmed up there first, as torch asks), in
    relaxed capture mode (the step pins the host tables it copies, and other threads of the trainer may use CUDA)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def warm(self, run: Callable[[], Any]) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = run()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="relaxed"):
            out = run()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass
class _Entry:
    """One fixed shape's static inputs (one int64 device buffer, its parts views of it; the bounds as int32), its
    eager steps so far, its graph and the objective the graph writes (static tensors), or why it stays eager."""

    shape: FixedShape
    values: torch.Tensor
    cu_seqlens: torch.Tensor
    warm: int = 0
    graph: Any = None
    objective: StepObjective | None = None
    layout: StepLayout | None = None      # the captured step's: its tables must outlive the graph
    failed: str | None = None
    held: int = 0                         # device bytes its graph's memory pool keeps (its step's activations)
    tunings: set = field(default_factory=set)   # the shapes still measured in its last eager step (kernel_tuning)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    addresses: tuple = ()                 # the jobs' buffers the graph reads and writes, where they were captured


class StepGraphs:
    """The trainer's graphed steps. `forward(layout, input_ids, position_ids)`: the base's final hidden states
    (T, d) of a step (the trainer's decoder call, in its contexts); `objective(hidden, parts)`: the step's loss
    (`step_objective.fixed_objective`)."""

    def __init__(self, device: torch.device, pad_token_id: int,
                 forward: Callable[[StepLayout, torch.Tensor, torch.Tensor], torch.Tensor],
                 objective: Callable[[torch.Tensor, dict[str, torch.Tensor]], StepObjective], *,
                 backend: GraphBackend | None = None):
        self.device, self.pad_token_id = device, pad_token_id
        self.forward, self.objective = forward, objective
        self.backend = backend if backend is not None else CudaGraphs()
        self.shapes: dict[tuple[str, ...], FixedShape] = {}   # each job set's shape so far (it only grows)
        self.entries: dict[FixedShape, _Entry] = {}            # in the order made: the oldest dropped past KEPT
        self.replays = 0
        self.captures = 0
        self.jobs: tuple[str, ...] = ()   # the job set of the last step
        self.ahead: tuple[tuple, FixedBatch] | None = None   # the next step's batch, made during this one
        self.refusals: set[str] = set()   # why steps ran eagerly (each logged once by the trainer)

    def fixed(self, packed: FusedBatch, ceilings: Ceilings | None = None) -> FixedBatch:
        """The packed host step in its job set's fixed shape (grown where it does not fit). `ceilings`: per job, the
        most tokens and rows its micro-batches hold (`fixed_shapes.shape_for`)."""
        shape = self.planned(tuple(packed.jobs), *counts_of(packed), ceilings)
        self.shapes[shape.jobs] = shape
        return fixed_batch(packed, shape, self.pad_token_id)

    def send_ahead(self, key: tuple, packed: FusedBatch, ceilings: Ceilings | None = None) -> None:
        """The next step's fixed host batch made now, while this step's kernels run (pinned for its copy), kept for
        a step of those very micro-batches (`key`: step_batches.batch_key)."""
        fixed = self.fixed(packed, ceilings)
        fixed.values = _pinned(fixed.values)
        self.ahead = (key, fixed)

    def take_ahead(self, key: tuple) -> FixedBatch | None:
        """The batch sent ahead, where it was made from these micro-batches and its shape is still its job set's;
        else None. Either way nothing sent ahead is kept for a later step."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] != key or self.shapes.get(ahead[1].shape.jobs) != ahead[1].shape:
            return None
        return ahead[1]

    def planned(self, jobs: tuple[str, ...], tokens: Sequence[int], rows: Sequence[int],
                ceilings: Ceilings | None = None) -> FixedShape:
        """The shape a step of these jobs' micro-batches (their tokens and rows) takes: its job set's so far, grown
        where they do not fit it (not kept: the memory plan asks it of candidate steps)."""
        shape = self.shapes.get(jobs)
        return shape_for(jobs, tokens, rows, ceilings) if shape is None else shape.holding_counts(tokens, rows,
                                                                                                 ceilings)

    def run(self, batch: FixedBatch, pools: Sequence[MasterPool]) -> StepObjective:
        """The step's forward, loss and backward (its gradients added into the jobs' buffers): eagerly while its
        shape warms up, else by replaying its graph (captured first where due). `pools`: the step's jobs' master
        pools, whose gradient views are attached here (a replay does not)."""
        if batch.shape.jobs != self.jobs:   # another job set: what the graphs read (stacks of its jobs' weights,
            self.entries.clear()           # its buffers) may be made anew; its graphs go, captured again on return
            self.jobs = batch.shape.jobs
        entry = self._entry(batch.shape)
        entry.values.copy_(_pinned(batch.values), non_blocking=True)
        for pool in pools:
            pool.grads.attach()
        if entry.graph is not None and entry.addresses != _addresses(pools):
            log.info("what a captured step reads moved (the jobs' buffers, or the layers' stacks after another "
                     "grouping of adapters ran: %s): it is captured again", ", ".join(entry.shape.jobs))
            entry.graph = entry.objective = entry.layout = None
            entry.warm = 0
        if entry.graph is None and entry.failed is None and self._due(entry):
            try:
                lora_stacks.KEPT.stale()
                before = _reserved(self.device)
                with every_refresh():   # the graph holds each refresh of the jobs' copies, due at every replay
                    entry.graph, (entry.objective, entry.layout) = self.backend.capture(lambda: self._step(entry))
                entry.held = max(_reserved(self.device) - before, 0)
                entry.addresses = _addresses(pools)
                self.captures += 1
                log.info("a fused step of %d tokens (jobs %s) captured as a graph after %d eager steps",
                         entry.shape.tokens, ", ".join(entry.shape.jobs), entry.warm)
            except Exception as error:   # noqa: BLE001 - any capture error leaves the shape eager, said once
                entry.failed = f"{type(error).__name__}: {error}"
                entry.graph = entry.objective = entry.layout = None
                log.warning("a fused step of %d tokens could not be captured as a graph; its shape stays eager "
                            "(%s)", entry.shape.tokens, entry.failed)
        if entry.graph is not None:
            return self._replay(entry, pools)
        entry.warm += 1
        return self.eager_step(entry)

    def _replay(self, entry: _Entry, pools: Sequence[MasterPool]) -> StepObjective:
        """The step by its graph (its inputs copied and the gradient views attached already): the objective the graph
        writes. `pools`: unused here; a subclass that checks replays (tests/helpers/graph_check.py) reads them."""
        del pools
        self.backend.replay(entry.graph)
        self.replays += 1
        return entry.objective

    def eager_step(self, entry: _Entry) -> StepObjective:
        """The step of `entry`'s shape run eagerly, as before its capture (on the capture's stream); the kernels'
        shapes it still measured are kept for `_due`."""
        with kernel_tuning.watched() as tunings:
            objective, _ = self.backend.warm(lambda: self._step(entry))
        entry.tunings = tunings
        return objective

    def held_bytes(self, shape: FixedShape | None = None) -> int:
        """Device memory the captured graphs keep in their pools (each its step's activations, which no other step
        can use), but `shape`'s: a step of that shape replays its graph in that memory."""
        return sum(entry.held for entry in self.entries.values() if entry.graph is not None and entry.shape != shape)

    def _due(self, entry: _Entry) -> bool:
        if entry.warm < WARMUP:
            return False
        if kernel_tuning.settled(entry.tunings):   # the step's own shapes (a capture must not time candidates)
            return True
        if entry.warm >= MAX_WARMUP:
            entry.failed = f"the LoRA kernels' measurements had not settled after {entry.warm} steps"
            log.warning("a fused step of %d tokens stays eager: %s", entry.shape.tokens, entry.failed)
        return False

    def _step(self, entry: _Entry) -> tuple[StepObjective, StepLayout]:
        parts = entry.parts
        entry.cu_seqlens.copy_(parts["cu_seqlens"])
        layout = fixed_layout(entry.shape, entry.cu_seqlens)
        hidden = self.forward(layout, parts["input_ids"], parts["position_ids"])
        objective = self.objective(hidden, parts)
        objective.total.backward()
        return objective, layout

    def _entry(self, shape: FixedShape) -> _Entry:
        entry = self.entries.get(shape)
        if entry is None:
            size = 4 * shape.tokens + sum(shape.slots) + 1 + len(shape.jobs)
            values = torch.zeros(size, dtype=torch.long, device=self.device)
            entry = _Entry(shape, values, torch.zeros(sum(shape.slots) + 1, dtype=torch.int32, device=self.device))
            entry.parts = split_parts(shape, values)
            self.entries[shape] = entry
            while len(self.entries) > KEPT:   # the oldest shape's graph and its memory go
                del self.entries[next(iter(self.entries))]
        return entry


def _addresses(pools: Sequence[MasterPool]) -> tuple:
    """Where the jobs' buffers a captured step reads and writes lie: each pool's masters, its compute-dtype casts
    and its gradient buffer; the layers' kept stacks (their version: it moves when a grouping of adapters is kept or
    dropped, as an evaluation's or a generation's first run between steps does, and their refresh table with them);
    and the model's layers (a layer wrapped or unwrapped, as "try it" does with a saved adapter: the frozen weights of
    layers computed together may be stacked anew). A graph replays those addresses: one that moved (a buffer made
    anew, a stack replaced and freed) needs a new capture."""
    return (lora_stacks.KEPT.version, surgeries()) + tuple(
        (pool.flat.data_ptr(), tuple(cast.data_ptr() for cast in pool.casts.values()),
         pool.grads.values.data_ptr() if pool.grads.values is not None else 0) for pool in pools)


def _reserved(device: torch.device) -> int:
    """The device's memory the allocator has reserved, with its free cache released first (as a capture begins:
    torch.cuda.graph empties it), so that what a capture reserves is its graph's pool; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def _pinned(values: torch.Tensor) -> torch.Tensor:
    return values.pin_memory() if torch.cuda.is_available() and not values.is_pinned() else values


def refusal(jobs: Sequence[Any], *, dtype: torch.dtype, layout: str, recompute: str, calls: bool) -> str | None:
    """Why a step of these jobs cannot take a graph (None: it can). `jobs`: their `TrainingJob`s."""
    if layout != "packed" or recompute != "none":
        return f"layout {layout} / recompute {recompute} (graphs take packed steps without recomputation)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"a {dtype} base (a float16 loss scale is read on the host)"
    if calls:
        return "interactive calls share the step"
    for job in jobs:
        if job.spec.method != "sft":
            return f"job '{job.spec.name}' is a {job.spec.method} job (graphs take sft jobs)"
        if job.spec.lora.dropout:
            return f"job '{job.spec.name}' has LoRA dropout (its masks are drawn on the host's generator)"
    return None
