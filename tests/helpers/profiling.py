"""A step's allocation peak as torch.profiler's memory timeline counts it (the reference)."""

from __future__ import annotations

from torch._C._profiler import _ExtraFields_Allocation
from torch.profiler import ProfilerActivity, profile


def _allocations(nodes) -> list[tuple[int, int, int]]:
    """(time, address, bytes) of every CPU allocation and free in the profiler's event tree."""
    found = []
    for node in nodes:
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            if fields.device.type == "cpu":
                found.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        else:
            found.extend(_allocations(node.children))
    return found


def profiler_peak(run) -> int:
    """Peak growth of live CPU allocations while `run()` runs: the profiler's raw memory records (one per
    allocation and free, with its address, bytes and time), summed in time order.

    A free counts only when its block was allocated inside this profile: torch's CPU allocator remembers the
    size of every block allocated while any profiler was on, so a block an earlier test's profile allocated
    and the garbage collector frees now is reported with its bytes; counted, such frees pulled the sum below
    its start (a step's peak of 19.5 MB read as 4.5 MB in one CI run)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    inside: set[int] = set()
    live = peak = 0
    for _, address, nbytes in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()),
                                     key=lambda record: record[0]):
        if nbytes > 0:
            inside.add(address)
        elif address in inside:
            inside.discard(address)
        else:
            continue
        live += nbytes
        peak = max(peak, live)
    return peak
