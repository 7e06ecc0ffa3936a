"""Ray-free compute core: base model loading, fused multi-LoRA layers, packing, per-job loss and
optimisation, PEFT-format adapters and memory measurement. Everything here runs in-process.

Importing it asks Intel MKL (PyTorch's CPU matrix products) for conditional numerical reproducibility
(`MKL_CBWR=AUTO,STRICT`, unless already set): by default MKL's float32 products may round differently
depending on where a matrix starts in memory, so one job's slice of a fused step could differ in the last
bits from the same job's tokens alone. MKL reads the setting at its first use, so it takes effect only
where nothing ran a CPU matrix product before this import (the trainer processes)."""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from actors.engine import library_notices  # after MKL's setting, before any library it names

library_notices.install()
