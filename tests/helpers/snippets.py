"""The code lines aspen prints for users, run as printed: in a fresh Python, with the hub offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def peft_lines(printed: str) -> str:
    """The Python that `aspen export` printed under "Load it with PEFT:" (indented two spaces)."""
    block = printed.split("Load it with PEFT:\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("  "):
            break
        lines.append(line[2:])
    return "\n".join(lines)


def run_printed_peft_lines(code: str, ids: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """`code` run as shown, in a fresh Python with the hub offline (as on a machine without internet), then the
    logits of `model` on `ids`, which it must have defined."""
    script = tmp_path / "load.py"
    logits = tmp_path / "logits.pt"
    rows = ids.tolist()
    script.write_text(code + "\nimport torch\nwith torch.no_grad():\n"
                             f"    torch.save(model.eval()(input_ids=torch.tensor({rows})).logits, {str(logits)!r})\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(logits)
