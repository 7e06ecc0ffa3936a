"""`aspen watch --events` as a real process for the MQTT tests: its stdout and stderr lines as they come."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


class Watcher:
    """`aspen ARGS...` (`aspen watch --events ...`) as a real process, its stdout and stderr lines collected."""

    def __init__(self, *args: str, cwd: Path | None = None):
        aspen = Path(sys.executable).with_name("aspen")
        self.process = subprocess.Popen([str(aspen), *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=s, t=t: t.extend(iter(s.readline, "")), daemon=True)
                        for s, t in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def said(self, text: str) -> list[str]:
        return [line for line in list(self.err) if text in line]

    def end(self, timeout: float = 20) -> int:
        """Ctrl-C unless it ended already; its exit code (killed where it does not end within `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            for reader in self.readers:
                reader.join(5)
