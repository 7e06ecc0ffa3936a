"""The CUDA device count `aspen run --device auto` takes without torch, checked against torch's own count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_cuda_count_is_torchs() -> None:
    """`cuda_device_count` (the CUDA driver, and whether torch was built with CUDA) against
    `torch.cuda.device_count()`, each in a fresh process: as the machine is, and with every device hidden
    (CUDA_VISIBLE_DEVICES empty)."""
    code = ("import json\nfrom actors.service.scheduler.cuda_devices import cuda_device_count\n"
            "mine = cuda_device_count()\nimport torch\nprint(json.dumps([mine, torch.cuda.device_count()]))")
    for hidden in (False, True):
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if hidden else {})}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=env, check=True)
        mine, torchs = json.loads(out.stdout)
        assert mine == torchs, (hidden, mine, torchs)
