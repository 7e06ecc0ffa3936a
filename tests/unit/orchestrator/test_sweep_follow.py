"""`aspen sweep`'s live lines (orchestrator/sweep.py `follow_sweep`): each trial named with its settings when it
starts, its step while it trains (at most every so often), why it stopped in words; never the same line twice."""

from __future__ import annotations

import pytest

from orchestrator.sweep import follow_sweep

pytestmark = pytest.mark.unit


def trial(name, state, steps, objective=None, why=None, lr=1e-3, r=8):
    return {"name": name, "state": state, "steps": steps, "objective": objective, "stopped_because": why,
            "settings": {"lr": lr, "lora.r": r}}


class Scripted:
    """A service whose sweep status follows a script, one entry per poll; the clock advances 4 s a poll."""

    def __init__(self, polls):
        self.polls, self.now = list(polls), 0.0

    def sweep_status(self, name):
        self.now += 4.0
        trials = self.polls.pop(0)
        done = not self.polls
        return {"name": name, "state": "done" if done else "running", "trials": trials}


def test_lines_name_settings_steps_and_stops():
    why = "objective 2.1 at step 4 is higher than 1.9, the objective of the one trial judged at step 4 before it"
    polls = [
        [trial("s-t0", "running", 0), trial("s-t1", "pending", 0, lr=0.1)],
        [trial("s-t0", "running", 1), trial("s-t1", "pending", 0, lr=0.1)],
        [trial("s-t0", "running", 2), trial("s-t1", "pending", 0, lr=0.1)],
        [trial("s-t0", "running", 3), trial("s-t1", "running", 0, lr=0.1)],
        [trial("s-t0", "running", 3), trial("s-t1", "running", 4, 2.1, lr=0.1)],
        [trial("s-t0", "completed", 8, 1.2), trial("s-t1", "stopped", 4, 2.1, why, lr=0.1)],
    ]
    service = Scripted(polls)
    lines = []
    follow_sweep(service, "s", poll_s=0, say=lines.append, progress_every_s=10, clock=lambda: service.now)
    assert lines == [
        "s-t0: running at step 0 (lr=0.001, lora.r=8)",
        "s-t0: running at step 3",                            # 12 s after its last line, and it advanced
        "s-t1: running at step 0 (lr=0.1, lora.r=8)",
        "s-t0: completed at step 8, objective 1.2000",
        f"s-t1: stopped at step 4, objective 2.1000: {why}",
    ]
    assert len(set(lines)) == len(lines)


def test_a_trial_its_users_quota_holds_back_is_said_once_not_in_silence():
    """The status's `waiting` (a trial the user's quota refuses for now: actors/service/sweeps/sweep_driver.py) is
    said when it appears and again only when the reason changes; the trial's start follows as any trial's."""
    held = "s-t1: user alice: quota queued=1: 1 of their jobs are queued and this adds 1"
    polls = [[trial("s-t0", "running", 0), trial("s-t1", "pending", 0)]] * 2 + [
        [trial("s-t0", "running", 0), trial("s-t1", "running", 0)],
        [trial("s-t0", "completed", 8, 1.2), trial("s-t1", "completed", 8, 1.1)]]

    class Held(Scripted):
        def __init__(self, polls, waiting):
            super().__init__(polls)
            self.waiting = list(waiting)

        def sweep_status(self, name):
            return {**super().sweep_status(name), "waiting": self.waiting.pop(0)}

    lines = []
    service = Held(polls, [held, held, None, None])
    follow_sweep(service, "s", poll_s=0, say=lines.append, progress_every_s=10, clock=lambda: service.now)
    assert lines == [f"waits to be submitted: {held} (submitted once the quota lets it in)",
                     "s-t0: running at step 0 (lr=0.001, lora.r=8)",
                     "s-t1: running at step 0 (lr=0.001, lora.r=8)",
                     "s-t0: completed at step 8, objective 1.2000",
                     "s-t1: completed at step 8, objective 1.1000"]
