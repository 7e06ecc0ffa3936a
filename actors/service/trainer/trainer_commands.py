"""What a trainer loop is asked from other threads (start jobs, stop one), queued until its next step
boundary, and its wake-up. A command, or a background upload that ended, ends its idle wait early."""

from __future__ import annotations

import queue
import threading

from actors.service.trainer.job_link import Assignment


class Commands:
    """What the loop is asked from other threads (start jobs, stop one), taken between steps, and its
    wake-up (a command, or a background upload that ended, ends its idle wait early)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.wake = threading.Event()
        # jobs to start at the next boundary: assigned again while still leaving here, or after a pipeline's
        # lost stage cut their command short
        self.deferred: list[Assignment] = []

    def put(self, command: tuple) -> None:
        self.queue.put(command)
        self.wake.set()

    def empty(self) -> bool:
        return self.queue.empty() and not self.deferred

    def next(self) -> tuple | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None

    def idle(self, seconds: float) -> None:
        """Wait up to `seconds`, less when woken."""
        self.wake.wait(seconds)
        self.wake.clear()
