"""The HTTP server's pipe to its Ray bridge (orchestrator/http/bridge.py) carries tensors by value: nothing is
left in the temporary folder by a process that leaves without its exit handlers (the bridge's `os._exit`).
Checked in fresh processes against multiprocessing's own pickler, which leaves its resource sharer's folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import multiprocessing, os, sys
import torch
from orchestrator.http.bridge import receive, send

ours, theirs = multiprocessing.get_context("spawn").Pipe()
message = (7, "ok", {"logprobs": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
if sys.argv[1] == "bridge":
    send(ours, message)
    number, kind, value = receive(theirs)
else:   # multiprocessing's own pickler, as the pipe was used before
    ours.send(message)
    number, kind, value = theirs.recv()
assert (number, kind) == (7, "ok") and torch.equal(value["logprobs"], message[2]["logprobs"])
os._exit(0)   # as the bridge leaves: no exit handlers
"""


@pytest.mark.parametrize("way", ["bridge", "multiprocessing"])
def test_a_tensor_crosses_the_bridge_pipe_by_value_and_leaves_no_folder(way):
    # a short folder of its own: the resource sharer's socket path must fit AF_UNIX's 108 bytes, which pytest's
    # tmp_path under xdist workers does not leave room for
    with tempfile.TemporaryDirectory(prefix="aspen-pipe-") as name:
        folder = Path(name)
        result = subprocess.run([sys.executable, "-c", CHILD, way], cwd=REPO, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(folder)})
        assert result.returncode == 0, result.stderr[-3000:]
        left = sorted(p.name for p in folder.iterdir())
    if way == "bridge":
        assert left == [], left
    else:   # the reference: the descriptor passed through a listener socket in a pymp-* folder, never removed
        assert len(left) == 1 and left[0].startswith("pymp-"), left
