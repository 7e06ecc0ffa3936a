"""Measures, in a process of its own, how much memory loading a quantized base takes at its peak: run as
`python -m tests.helpers.load_peak_probe FOLDER new|old int8|nf4`, prints one JSON line.

The counter is the process's anonymous resident memory (`RssAnon` of /proc/self/status: what it
allocated and touched, not the checkpoint file that safetensors maps, which is file-backed), sampled
every 0.2 ms on a thread while the model loads, the peak minus the value before. glibc's malloc must
give freed blocks back for this to track live allocations: the test starts the probe with a fixed
`MALLOC_MMAP_THRESHOLD_` (large blocks mapped and unmapped one by one, not kept in the heap).

- new: `actors.engine.models.load_model`, the engine's way (quantized while loading);
- old: the previous way, the whole model loaded in float first, then its linear layers quantized."""

from __future__ import annotations

import gc
import json
import sys
import threading
import time

import torch


def resident_anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds: parameters, buffers and bitsandbytes' quantization state
    (int8 row scales `SCB`, NF4 block maxima and their own quantization state)."""
    tensors: dict[int, int] = {}

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor):
            tensors[tensor.data_ptr()] = tensor.numel() * tensor.element_size()

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor)
        add(getattr(tensor, "SCB", None))
        state = getattr(tensor, "quant_state", None)
        for owner in (state, getattr(state, "state2", None)):
            for name in ("absmax", "code", "offset"):
                add(getattr(owner, name, None))
    return sum(tensors.values())


def load(folder: str, way: str, quantization: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from actors.engine.models import load_model, quantize_linears
    from actors.storage.sources import resolve_source

    if way == "new":
        return load_model(resolve_source(folder), torch.bfloat16, torch.device("cpu"), quantization)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    quantize_linears(model, quantization, torch.bfloat16, torch.device("cpu"))
    return model


def main(folder: str, way: str, quantization: str) -> None:
    sys.setswitchinterval(1e-4)            # let the sampling thread in between the loader's Python steps
    load(folder, way, quantization)        # once first: lazy imports and one-time set-ups are not loading
    gc.collect()
    before = resident_anonymous_bytes()
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, resident_anonymous_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = load(folder, way, quantization)
    done.set()
    sampler.join()
    peak = max(peak, resident_anonymous_bytes())
    print(json.dumps({"peak_bytes": peak - before, "model_bytes": tensor_bytes(model)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
