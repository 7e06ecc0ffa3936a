"""Calls waiting on a trainer busy in a long pass, in the process holding the Ray connection
(orchestrator/tinker/tinker_service.py), against a real Ray actor that answers one call at a time as a trainer
does: many calls sent to it while it is busy hold no thread of that process while they wait (each was waited for
`QUEUE_WAIT_S`, 10 s, on one of the HTTP bridge's 16 threads, so hundreds of an RL loop's samples slowed every other
request of that server), each runs on the actor exactly once, and one `ready` request tells which have answers."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.service

PASS_S = 6.0    # the busy pass
WAITING = 60    # calls sent while it runs


@pytest.fixture(scope="module")
def busy_trainer(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class OneCallAtATime:
        """A trainer's tinker_* methods as far as waiting goes: each call recorded, its key its order."""

        def __init__(self):
            self.calls: list[str] = []
            self.beats = 0

        def long_pass(self, seconds: float) -> None:
            time.sleep(seconds)

        def tinker_sample(self, front: str, call: str) -> str:
            self.calls.append(call)
            return f"key-{len(self.calls)}"

        def tinker_beat(self, model_ids: list[str]) -> list[str]:
            self.beats += 1
            return []

        def seen(self) -> tuple[list[str], int]:
            return self.calls, self.beats

    actor = OneCallAtATime.remote()
    ray.get(actor.seen.remote())
    yield actor
    ray.kill(actor)


def test_calls_to_a_busy_trainer_wait_without_holding_a_thread_and_each_runs_once(busy_trainer, monkeypatch):
    import ray
    from fastapi import HTTPException

    from orchestrator.tinker import tinker_service
    from orchestrator.tinker.tinker_service import BUSY_HEADER, TinkerService

    monkeypatch.setattr(tinker_service, "QUEUE_WAIT_S", 1.0)
    service = TinkerService(scheduler=None)
    service.handles["trainer-0"] = busy_trainer
    busy_trainer.long_pass.remote(PASS_S)

    def busy(token: str, call: str) -> float:
        started = time.monotonic()
        with pytest.raises(HTTPException) as raised:
            service.sample("trainer-0", "front-a", call, token)
        assert raised.value.status_code == 503 and BUSY_HEADER in raised.value.headers
        return time.monotonic() - started

    first = busy("t-0", "call-0")
    assert first >= tinker_service.QUEUE_WAIT_S   # not known busy yet: the one wait
    # known busy now: the others are queued there and answered busy at once; so is a kept call asked for again, and a
    # heartbeat is queued behind the pass, not waited for
    waits = [busy(f"t-{n}", f"call-{n}") for n in range(1, WAITING)] + [busy("t-0", "call-0")]
    assert service.beat("trainer-0", ["model-a"]) == []
    assert all(wait < tinker_service.QUEUE_WAIT_S for wait in waits), max(waits)
    assert sum(waits) < PASS_S, sum(waits)   # each waiting a queue wait would be WAITING seconds

    tokens = [f"t-{n}" for n in range(WAITING)]
    assert service.ready(tokens, timeout=0) == []   # still in its pass
    keys: dict[str, str] = {}
    deadline = time.monotonic() + PASS_S + 60
    while len(keys) < WAITING:
        assert time.monotonic() < deadline, f"{WAITING - len(keys)} calls never answered"
        for token in service.ready([t for t in tokens if t not in keys]):
            keys[token] = service.sample("trainer-0", "front-a", "not sent again", token)
    calls, beats = ray.get(busy_trainer.seen.remote())
    assert calls == [f"call-{n}" for n in range(WAITING)], "each call ran once, in the order sent"
    assert keys == {f"t-{n}": f"key-{n + 1}" for n in range(WAITING)}
    assert beats == 1
    assert service.kept == {}
    assert service.ready(["never-kept"]) == ["never-kept"]   # asked for again, it is sent anew


def test_calls_kept_through_a_pass_longer_than_the_keeping_time_are_not_sent_twice(busy_trainer, monkeypatch):
    """A pass outlasting `KEPT_S` (the time a kept call no one asks for is kept: its front gone): a front that waits
    for its calls (`ready`, as its waiting thread does) keeps them, and each runs once, however long the pass."""
    import ray
    from fastapi import HTTPException

    from orchestrator.tinker import tinker_service
    from orchestrator.tinker.tinker_service import TinkerService

    monkeypatch.setattr(tinker_service, "QUEUE_WAIT_S", 0.5)
    monkeypatch.setattr(tinker_service, "KEPT_S", 1.5)
    service = TinkerService(scheduler=None)
    service.handles["trainer-0"] = busy_trainer
    before = len(ray.get(busy_trainer.seen.remote())[0])
    busy_trainer.long_pass.remote(PASS_S)
    tokens = [f"k-{n}" for n in range(3)]
    for n, token in enumerate(tokens):
        with pytest.raises(HTTPException):
            service.sample("trainer-0", "front-b", f"kept-{n}", token)
    kept_at = time.monotonic()
    keys: dict[str, str] = {}
    late = None
    deadline = time.monotonic() + PASS_S + 60
    while len(keys) < len(tokens):
        assert time.monotonic() < deadline, f"{len(tokens) - len(keys)} calls never answered"
        for token in service.ready([t for t in tokens if t not in keys], timeout=1.0):
            keys[token] = service.sample("trainer-0", "front-b", "sent again", token)
        if late is None and time.monotonic() - kept_at > 2 * tinker_service.KEPT_S:
            # another call, past the keeping time of the first ones, while they wait
            with pytest.raises(HTTPException):
                service.sample("trainer-0", "front-b", "late", "k-late")
            late = "k-late"
    calls = ray.get(busy_trainer.seen.remote())[0][before:]
    assert calls[:3] == ["kept-0", "kept-1", "kept-2"] and "sent again" not in calls, calls
    assert sorted(keys.values()) == sorted(f"key-{before + n + 1}" for n in range(3))
