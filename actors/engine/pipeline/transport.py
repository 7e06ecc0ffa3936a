"""How pipeline stages talk: `torch.distributed` point-to-point over a process group set up the way Ray Train
sets up its workers' (a TCP rendezvous at rank 0's address; NCCL between GPUs, gloo between CPU processes).

Two channels: `data` carries activations and their gradients on the stages' devices (NCCL on GPUs, so GPU
tensors never pass through host memory; gloo on CPU); `control` (always gloo, host memory) carries the small
things: the head's plans and commands, the last stage's results, dropout generators' states and the jobs'
partial gradient norms. Every send is asynchronous (its tensor kept alive until done); a receive blocks and
its waiting time is counted (a stage's bubble).

Stages that share one GPU cannot use NCCL (it puts one rank per device): `queues` (a `shared_queues` set, made
by the parent of all stage processes) carry their activations and gradients instead through
torch.multiprocessing queues, which pass a CUDA tensor between processes by CUDA IPC (device memory, not
host memory) and a CPU tensor through shared memory; the receiver copies it into its own memory. A stage
that dies is then noticed only by its control messages, or after `timeout_s` on the data channel."""

from __future__ import annotations

import pickle
import queue
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# message kinds: each has its own tag, so that a kind's messages between two stages keep their order
TAG_ACTIVATION, TAG_GRADIENT, TAG_GENERATOR, TAG_PARTIAL, TAG_TOTAL, TAG_RESULT, TAG_COMMAND, TAG_REPLY = range(1, 9)


def open_rendezvous(world: int, timeout_s: float) -> dist.TCPStore:
    """Stage 0's rendezvous store, listening on every interface at a port the OS picks as it binds it (a port
    probed free and bound later could be taken meanwhile by another process); the other stages connect to its
    `.port` at stage 0's address. Each marks itself ready there (`ready_key`) once its share of the base is
    loaded, so that stage 0 can watch them start (pipeline_processes.py) rather than block in
    `init_process_group` until its timeout when one never comes."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def ready_key(rank: int) -> str:
    return f"aspen/stage-ready/{rank}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def shared_queues(context: Any, stages: int) -> dict[tuple[int, int, int], Any]:
    """The data channel's queues of a pipeline whose stages share a device: (from, to, tag) -> queue, for each
    stage's activations to the next and gradients to the one before. `context`: a multiprocessing context."""
    out = {}
    for stage in range(stages - 1):
        out[(stage, stage + 1, TAG_ACTIVATION)] = context.Queue()
        out[(stage + 1, stage, TAG_GRADIENT)] = context.Queue()
    return out


class StageLinks:
    """This stage's ends of the two channels."""

    def __init__(self, rank: int, world: int, address: str, port: int, device: torch.device,
                 timeout_s: float = 600.0, queues: dict[tuple[int, int, int], Any] | None = None,
                 store: dist.Store | None = None):
        """`store`: stage 0's rendezvous (`open_rendezvous`); the other stages connect to it at `address`:`port`
        and mark themselves ready there."""
        self.rank, self.world, self.device = rank, world, device
        self.queues = queues
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        if dist.is_initialized():
            raise RuntimeError("this process already holds a pipeline stage (torch.distributed is initialised): "
                               "one pipeline per process; close the other first")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "gloo" if queues is not None else backend_for(device)   # queues: no NCCL communicator
        if store is None:
            store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
            store.set(ready_key(rank), "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        self.data = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.waited = 0.0        # seconds blocked in receives

    def close(self, *, flush: bool = True) -> None:
        """Leave the process group; `flush=False` after a failure (a peer may never take what is pending)."""
        if flush:
            self.flush()
        self.pending.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.data = self.control = None   # the groups' handles go now, with their threads and the store

    # -- sending -------------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int, group) -> None:
        self.pending.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))
        if len(self.pending) > 64:
            self.pending = [(work, kept) for work, kept in self.pending if not work.is_completed()]

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if self.queues is not None:
            self.queues[(self.rank, dst, tag)].put(tensor.detach().contiguous())
            return
        self._isend(tensor.contiguous(), dst, tag, self.data)

    def send_object(self, value: object, dst: int, tag: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self._isend(torch.tensor([payload.numel()], dtype=torch.int64), dst, tag, self.control)
        self._isend(payload, dst, tag, self.control)

    def send_float(self, value: float, dst: int, tag: int) -> None:
        self._isend(torch.tensor([value], dtype=torch.float64), dst, tag, self.control)

    def send_state(self, state: torch.Tensor, dst: int, tag: int) -> None:
        """A random generator's state (a CPU byte tensor whatever the device)."""
        self._isend(state.clone(), dst, tag, self.control)

    def send_host(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """A tensor over the control channel (host memory; `recv_host` knows its shape): a decoding step's logits."""
        self._isend(tensor.detach().to("cpu").contiguous(), dst, tag, self.control)

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # -- receiving -----------------------------------------------------------------------------------
    def _recv(self, tensor: torch.Tensor, src: int, tag: int, group) -> torch.Tensor:
        started = time.perf_counter()
        dist.recv(tensor, src, group=group, tag=tag)
        self.waited += time.perf_counter() - started
        return tensor

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        if self.queues is None:
            return self._recv(torch.empty(shape, dtype=dtype, device=self.device), src, tag, self.data)
        started = time.perf_counter()
        try:
            shared = self.queues[(src, self.rank, tag)].get(timeout=self.timeout_s)
        except queue.Empty as error:
            raise RuntimeError(f"pipeline stage {src} sent nothing to stage {self.rank} within {self.timeout_s:.0f} s "
                               "(lost, or hung)") from error
        self.waited += time.perf_counter() - started
        if tuple(shared.shape) != tuple(shape) or shared.dtype != dtype:
            raise RuntimeError(f"pipeline stage {self.rank} expected a {tuple(shape)} {dtype} tensor from stage {src} "
                               f"and got {tuple(shared.shape)} {shared.dtype}")
        return torch.empty(shape, dtype=dtype, device=self.device).copy_(shared)   # its own memory

    def recv_host(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        return self._recv(torch.empty(shape, dtype=dtype), src, tag, self.control)

    def recv_object(self, src: int, tag: int) -> object:
        size = int(self._recv(torch.empty(1, dtype=torch.int64), src, tag, self.control))
        payload = self._recv(torch.empty(size, dtype=torch.uint8), src, tag, self.control)
        return pickle.loads(payload.numpy().tobytes())

    def recv_float(self, src: int, tag: int) -> float:
        return float(self._recv(torch.empty(1, dtype=torch.float64), src, tag, self.control))

    def recv_state(self, size: int, src: int, tag: int) -> torch.Tensor:
        return self._recv(torch.empty(size, dtype=torch.uint8), src, tag, self.control)
