"""How many CUDA devices a trainer started here would get, asked without importing torch.

`aspen run` with `device: auto` decides in its driver whether the trainer asks Ray for a GPU; importing torch
there (to call `torch.cuda.is_available()`) cost every run some 1.5 s of CPU and 300 MB before anything started.
The same answer comes from the CUDA driver itself (which honours `CUDA_VISIBLE_DEVICES`, as torch does) and
whether the installed torch was built with CUDA (its `libtorch_cuda` library: a CPU wheel on a GPU machine
trains on the CPU)."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0


def torch_has_cuda() -> bool:
    """Whether the installed torch was built with CUDA (its lib/ holds libtorch_cuda), without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any((Path(folder) / "lib").glob("libtorch_cuda*")) for folder in spec.submodule_search_locations)


def driver_device_count() -> int:
    """The CUDA driver's count of the devices this process may use (0: no driver, or none visible)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    status = driver.cuInit(0)
    if status != CUDA_SUCCESS:   # e.g. 100, no device (CUDA_VISIBLE_DEVICES empty), or a driver too old
        log.info("the CUDA driver is installed but cuInit failed (CUresult %d): no GPU for this run", status)
        return 0
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != CUDA_SUCCESS:
        log.info("the CUDA driver could not count its devices (CUresult %d): no GPU for this run", status)
        return 0
    return count.value


def cuda_device_count() -> int:
    """What `torch.cuda.device_count()` would say in a process started here, without importing torch."""
    return driver_device_count() if torch_has_cuda() else 0
