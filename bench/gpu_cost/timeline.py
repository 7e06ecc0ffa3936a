"""The step as a timeline: the host issues the recorded operations one after another, each at a host cost;
the GPU runs each kernel after it is issued and after the kernel before it (one stream), with a gap between
kernels; at most `Host.queue` kernels wait in the launch queue (the host blocks beyond, as CUDA's does); a
synchronisation makes the host wait for the GPU. A step ends when both are done; steps run back to back, so
work the host leaves queued at a step's end delays the next step.

Host cost of an operation = `Host.python` per Python function and `Host.call` per torch function or method
the step's code called since the operation before, + `Host.view` for an operation that launches nothing (a
view, metadata) or `Host.kernel` for one that launches (dispatch, autograd, the launch; `Host.kernels` in its
place for the kinds of operation it names) and `Host.launch` per launch beyond its first, + `Host.node` where it
starts an autograd node (the engine's own work); all times `Host.scale` (the profiled costs include the profiler's
overhead); a synchronisation adds `Host.sync`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_cost.card import Card, kernel_launches, kernel_time
from gpu_cost.operations import Op

# categories for the report, by operation (anything else: "other")
CATEGORIES = {
    "bmm": "bmm", "baddbmm": "bmm", "baddbmm_": "bmm", "mm": "mm", "addmm": "mm", "addmm_": "mm",
    "_grouped_mm": "grouped_mm",
    "_index_put_impl_": "index_put", "index_put": "index_put", "index_put_": "index_put",
    "index_add_": "index_put", "index": "index (gathers)", "index_select": "index (gathers)",
    "gather": "index (gathers)", "embedding": "index (gathers)",
    "_to_copy": "copies and casts", "copy_": "copies and casts", "clone": "copies and casts",
    "slice_backward": "slice/select backward", "select_backward": "slice/select backward",
    "mul": "mul", "mul_": "mul", "add": "add", "add_": "add",
    "zeros": "fills", "new_zeros": "fills", "zeros_like": "fills", "fill_": "fills", "zero_": "fills",
    "ones_like": "fills", "new_ones": "fills", "full": "fills", "new_full": "fills", "ones": "fills",
    "_varlen_attn": "attention", "_varlen_attn_backward": "attention", "_flash_attention_forward": "attention",
    "_flash_attention_backward": "attention", "_scaled_dot_product_flash_attention": "attention",
    "_scaled_dot_product_flash_attention_backward": "attention",
    "_fused_adamw_": "optimizer", "_fused_adam_": "optimizer",
    "cat": "cat/stack", "stack": "cat/stack",
    "memcpy_h2d": "host-device copies", "memcpy_d2h": "host-device copies",
}


def category(op: Op) -> str:
    if op.name.startswith("_foreach_"):
        return "optimizer"
    if op.name.startswith("triton:"):
        return "Triton kernels"
    return CATEGORIES.get(op.name, "other")


@dataclass(frozen=True)
class Host:
    python: float = 0.5e-6      # s per Python function called (the harness's own aside)
    call: float = 2e-6          # s per torch call from Python
    view: float = 2e-6          # s per operation launching nothing
    kernel: float = 10e-6       # s per operation launching kernels (its first launch included)
    launch: float = 5e-6        # s per further launch of one operation
    node: float = 4e-6          # s per autograd node
    scale: float = 1.0          # unprofiled / profiled host time
    sync: float = 20e-6         # s per synchronisation beyond waiting for the GPU
    queue: int = 1024           # kernels CUDA's launch queue holds before the host blocks
    # s per launching operation of a kind ("triton" for any Triton kernel, else the operation's name), in place of
    # `kernel` for the kinds it names (a machine's host probe measures them: calibration.host_from_probe)
    kernels: dict = field(default_factory=dict, compare=False)
    sources: dict = field(default_factory=dict, compare=False)

    def kernel_cost(self, op: Op) -> float:
        """What issuing a launching operation costs (its first launch included), before `scale`."""
        if not self.kernels:
            return self.kernel
        return self.kernels.get("triton" if op.name.startswith("triton:") else op.name, self.kernel)

    def cost(self, op: Op, launches: int) -> float:
        if op.detail.get("graphed"):   # replayed from a captured CUDA graph: the host issues nothing of it
            return 0.0
        issue = self.kernel_cost(op) + self.launch * (launches - 1) if launches else self.view
        work = self.python * op.python + self.call * op.calls + issue
        return self.scale * (work + (self.node if op.new_node else 0.0))


@dataclass
class StepTiming:
    seconds: float = 0.0
    gpu_seconds: float = 0.0          # kernels and copies
    gap_seconds: float = 0.0          # the GPU's gaps between back-to-back kernels
    host_seconds: float = 0.0         # host work, waits excluded
    wait_seconds: float = 0.0         # host waiting at synchronisations and on a full queue
    launches: int = 0
    syncs: int = 0
    operations: int = 0
    categories: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_busy(self) -> float:
        return self.gpu_seconds / self.seconds if self.seconds else 0.0


def simulate(steps: list[list[Op]], card: Card, host: Host) -> list[StepTiming]:
    """The steps back to back on one host and one GPU stream; each step's time is the advance of
    max(host, GPU) over it."""
    now_host = now_gpu = 0.0
    pending: deque[float] = deque()   # end times of the kernels still queued or running
    timings = []
    for ops in steps:
        timing = StepTiming()
        begin = max(now_host, now_gpu)
        for op in ops:
            launches = kernel_launches(op)
            cost = host.cost(op, launches)
            now_host += cost
            timing.host_seconds += cost
            timing.operations += 1
            if launches:
                while len(pending) >= host.queue:
                    release = pending.popleft()
                    if release > now_host:
                        timing.wait_seconds += release - now_host
                        now_host = release
                duration = kernel_time(op, card)
                gap = card.launch_gap * launches
                start = max(now_host, now_gpu + gap)
                timing.gap_seconds += min(gap, start - now_gpu) if start > now_gpu else 0.0
                now_gpu = start + duration
                pending.extend([now_gpu] * launches)
                timing.gpu_seconds += duration
                timing.launches += launches
                name = category(op)
                timing.categories[name] = timing.categories.get(name, 0.0) + duration
            while pending and pending[0] <= now_host:
                pending.popleft()
            if op.sync:
                timing.syncs += 1
                if now_gpu > now_host:
                    timing.wait_seconds += now_gpu - now_host
                    now_host = now_gpu
                now_host += host.sync
                timing.host_seconds += host.sync
                pending.clear()
        timing.seconds = max(now_host, now_gpu) - begin
        timings.append(timing)
    return timings
