"""A service YAML's trainer memory budgets checked against the machine before `aspen serve` joins Ray.

A kind's `memory_budget_bytes` larger than what its trainer could ever have (the RAM of a CPU trainer's node, the
memory of a GPU trainer's device) was caught only once the service ran: its trainer waited for a node, and placement
then said no node of the cluster has that memory. Where the cluster is this machine's (no RAY_ADDRESS, and
`--address` the default `auto` or an address of this machine), the budgets are checked against this machine's total
RAM (psutil) and, for GPU kinds where CUDA is there, its largest device (torch.cuda.get_device_properties), and a
budget over it is refused before anything starts: the file, the field, the machine's size and the fix. A cluster
named by RAY_ADDRESS may have larger nodes than this machine: it is not checked here (placement says it there)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from actors.service.scheduler.config import ServiceConfig

GIB = 2**30


def cluster_is_this_machine(address: str | None) -> bool:
    """Whether `aspen serve --address` (or its default) names the cluster on this machine, no RAY_ADDRESS set."""
    if os.environ.get("RAY_ADDRESS"):
        return False
    if not address or address == "auto":
        return True
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    try:
        from ray.util import get_node_ip_address

        return host == get_node_ip_address()
    except Exception:   # noqa: BLE001 - no address of this machine to compare with: not known to be this machine
        return False


def machine_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def largest_gpu_bytes() -> int | None:
    """The memory of this machine's largest CUDA device; None where there is none (or no CUDA build of torch)."""
    from actors.service.scheduler.cuda_devices import cuda_device_count

    if not cuda_device_count():
        return None
    import torch

    return max(torch.cuda.get_device_properties(index).total_memory for index in range(torch.cuda.device_count()))


def budgets_over_machine(config: ServiceConfig, source: str, ram: Callable[[], int] = machine_ram_bytes,
                         gpu: Callable[[], int | None] = largest_gpu_bytes) -> list[str]:
    """What of `config`'s trainer kinds' budgets this machine cannot hold, each naming `source` (the YAML file), the
    field, the machine's size and the fix; [] where every one fits (or no GPU here to compare a GPU kind with)."""
    problems = []
    for index, kind in enumerate(config.trainers or []):
        budget = kind.memory_budget_bytes
        if budget is None:
            continue
        field = f"trainers[{index}].memory_budget_bytes"
        if kind.num_gpus == 0:
            total = ram()
            if budget > total:
                problems.append(
                    f"{source}: {field} is {budget} ({budget / GIB:.1f} GiB), more than this machine's memory "
                    f"({total / GIB:.1f} GiB, {total} bytes): no trainer of it could ever start here. Set it below "
                    f"{total} (or leave it out: half the RAM, shared by the CPU trainers of a node), or run the "
                    "service on a cluster that has such a node (RAY_ADDRESS or --address of a cluster elsewhere)")
            continue
        device = gpu()
        if device is not None and budget > device:
            problems.append(
                f"{source}: {field} is {budget} ({budget / GIB:.1f} GiB) for a GPU trainer, more than this machine's "
                f"largest GPU ({device / GIB:.1f} GiB, {device} bytes): no trainer of it could ever start here. Set "
                f"it below {device} (or leave it out: 90% of the GPU), or run the service on a cluster that has such "
                "a GPU (RAY_ADDRESS or --address of a cluster elsewhere)")
    return problems
