"""The Tinker API's facts of a base (context, tokenizer: what the SDK's clients are told) on a trainer the API has
not asked before, while that trainer is in a long pass: answered at once from the trainer's status as the
scheduler has it, the same facts the trainer itself gives once free (it waited for the pass, up to 60 s). On a
real service; the trainer is held busy by a call in its own process."""

from __future__ import annotations

import time

import ray

from orchestrator.tinker.tinker_service import TinkerService
from tests.helpers.service import wait_for
from tests.helpers.try_it_probes import hold_busy

HOLD_S = 20.0   # how long the trainer is kept busy


def test_the_facts_of_a_trainer_first_asked_in_its_long_pass_come_at_once(api, tmp_path):
    wait_for(lambda: any(t.get("ready") for t in ray.get(api.ray.scheduler.trainers.remote(), timeout=60)),
             timeout=180, what="a ready trainer")
    trainer = next(t["id"] for t in ray.get(api.ray.scheduler.trainers.remote(), timeout=60) if t.get("ready"))
    handle = ray.get(api.ray.scheduler.__ray_call__.remote(lambda scheduler: scheduler.fleet.handle_of(trainer)),
                     timeout=60)
    marker, release = tmp_path / "trainer-busy", tmp_path / "trainer-free"
    busy = hold_busy(handle, marker, HOLD_S, release)   # in the trainer's process: its one call at a time
    try:
        wait_for(marker.exists, timeout=60, what="the trainer to be busy")
        started = time.monotonic()
        facts = TinkerService(api.ray.scheduler).facts(trainer)   # a new front: it has asked no trainer before
        waited = time.monotonic() - started
        assert not ray.wait([busy], timeout=0)[0], "the trainer was busy all along"
        assert waited < 5.0, waited
    finally:
        release.touch()   # the trainer freed (not HOLD_S waited out)
    ray.get(busy, timeout=60)
    assert facts == ray.get(handle.tinker_facts.remote(), timeout=60)   # what the trainer itself says, once free
    assert facts["context"] and facts["eos"] is not None
