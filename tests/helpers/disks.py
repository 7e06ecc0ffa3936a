"""Tiny file systems that fill up (an operator's full disk), for the fault tests: the `small_disks` fixture
(registered in conftest.py) and `fill`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def small_disks(tmp_path):
    """Tiny tmpfs file systems mounted where jobs will write (root only: an operator's full disk)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(folder: Path, size: str = "1m") -> Path:
        folder.mkdir(parents=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Take every byte left on `folder`'s file system."""
    with (folder / "filler").open("wb", buffering=0) as handle:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    handle.write(b"\0" * chunk)
            except OSError:
                continue
