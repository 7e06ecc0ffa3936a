"""A "try it" (POST /v1/jobs/{job}/generate) whose trainer stays busy past the service's wait, through the HTTP API
on a real server over a real service: the answer is the service's own, when its wait ends (not the HTTP layer's
later, generic 503): a 503 that says the trainer is busy with a step or a generation, how long was waited and to
try again, with a Retry-After; the service's link is kept, and the same request once the trainer is free is
answered. The scheduler's wait (90 s) is shortened in its process, the trainer held busy by a call in its own.
A "try it" so abandoned is withdrawn from the trainer: it never runs there, and the retry does not wait behind it
(what the trainer ran is counted in its own process). So is one whose HTTP client disconnects, at once (the
scheduler's wait not shortened): queued, it never runs; generating, it stops (its decode steps counted in the
trainer's process) and the trainer trains on."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import ray

from actors.service.scheduler.call_waits import BUSY_RETRY_AFTER_S, GENERATE_WAIT_S, SCHEDULER_CALL_WAIT_S
from orchestrator.http.api_client import DEFAULT_TIMEOUT_S, HttpClient
from orchestrator.http.bridge import CALL_TIMEOUT_S
from tests.helpers.service import job_dict, wait_for, write_task_data
from tests.helpers.try_it_probes import count_tries, hang_up_while_decoding, hold_busy, tickets

WAIT_S = 2.0    # the scheduler's wait for the trainer, shortened from GENERATE_WAIT_S
HOLD_S = 12.0   # how long the trainer is kept busy: far past that wait


def _scheduler_wait(api, seconds: float, trainer: str):
    """Set the scheduler's "try it" wait in its own process: (the wait it had, the trainer's actor handle)."""
    def run(scheduler, seconds=seconds, trainer=trainer):
        import inspect

        names = inspect.unwrap(type(scheduler).generate).__globals__   # what `generate` reads (Ray wraps it)
        before, names["GENERATE_WAIT_S"] = names["GENERATE_WAIT_S"], seconds
        return before, scheduler.fleet.handle_of(trainer)

    return ray.get(api.ray.scheduler.__ray_call__.remote(run), timeout=60)


def _training(api, tmp_path, name: str):
    """(an HTTP client, its job `name` of 100,000 steps once it trains, the job's trainer)."""
    http = HttpClient(api.url, api.token)
    job = http.submit(job_dict(name, write_task_data(tmp_path / "data", name), 100_000, checkpoint_every=100_000),
                      base_model=api.base)
    wait_for(lambda: api.ray.status(job.id).state == "running" and api.ray.status(job.id).step >= 1, timeout=180,
             what="the job to train", state=lambda: api.ray.status(job.id))
    return http, job, api.ray.status(job.id).trainer


def test_a_try_it_whose_trainer_stays_busy_is_told_so_when_the_services_wait_ends(api, tmp_path):
    # each wait longer than the one it waits on: the service's answer reaches the HTTP user first
    assert GENERATE_WAIT_S < SCHEDULER_CALL_WAIT_S < CALL_TIMEOUT_S < DEFAULT_TIMEOUT_S
    http, job, trainer = _training(api, tmp_path, "busy")
    before, handle = _scheduler_wait(api, WAIT_S, trainer)
    assert before == GENERATE_WAIT_S
    marker, release = tmp_path / "trainer-busy", tmp_path / "trainer-free"
    try:
        busy = hold_busy(handle, marker, HOLD_S, release)   # in the trainer's process
        wait_for(marker.exists, timeout=60, what="the trainer to be busy")
        prompt = {"prompt": "Q: busy 1 and 3\nA:", "max_new_tokens": 4}
        started = time.monotonic()
        answer = httpx.post(f"{api.url}/v1/jobs/{job.id}/generate", json=prompt, headers=api.auth(), timeout=120)
        waited = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == str(BUSY_RETRY_AFTER_S)
        detail = answer.json()["detail"]
        assert detail.startswith(f"trainer {trainer} is busy with a training step or another generation: it did "
                                 f"not answer this \"try it\" within {WAIT_S:.0f} s"), detail
        assert f"try again in {BUSY_RETRY_AFTER_S} s or later" in detail
        assert WAIT_S <= waited < HOLD_S, waited   # the service's wait, not the HTTP layer's
        assert not ray.wait([busy], timeout=0)[0], "the trainer was free before the service's answer"
        release.touch()   # the trainer freed (not HOLD_S waited out)
        ray.get(busy, timeout=60)
        # the trainer free again: the same request is answered, over the same link
        answer = httpx.post(f"{api.url}/v1/jobs/{job.id}/generate", json=prompt, headers=api.auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["job"] == job.id and answer.json()["prompt"] == prompt["prompt"]
    finally:
        release.touch()
        _scheduler_wait(api, GENERATE_WAIT_S, trainer)
        http.cancel(job.id)


def test_a_try_it_the_service_gave_up_on_never_runs_on_the_trainer_nor_holds_up_the_retry(api, tmp_path):
    http, job, trainer = _training(api, tmp_path, "gone")
    _, handle = _scheduler_wait(api, WAIT_S, trainer)
    marker, release = tmp_path / "trainer-busy", tmp_path / "trainer-free"
    try:
        assert count_tries(handle, on=True) == []
        busy = hold_busy(handle, marker, HOLD_S, release)   # in the trainer's process
        wait_for(marker.exists, timeout=60, what="the trainer to be busy")
        abandoned = {"prompt": "Q: abandoned 1 and 3\nA:", "max_new_tokens": 4}
        answer = httpx.post(f"{api.url}/v1/jobs/{job.id}/generate", json=abandoned, headers=api.auth(), timeout=120)
        assert answer.status_code == 503, answer.text
        assert "the request was withdrawn from it" in answer.json()["detail"]
        assert not ray.wait([busy], timeout=0)[0], "the trainer was free before the service's answer"
        release.touch()   # the trainer freed (not HOLD_S waited out)
        ray.get(busy, timeout=60)
        # the retry, sent by the same scheduler after the abandoned one: had that one stayed queued, it ran first
        retry = {"prompt": "Q: retry 1 and 3\nA:", "max_new_tokens": 4}
        answer = httpx.post(f"{api.url}/v1/jobs/{job.id}/generate", json=retry, headers=api.auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["prompt"] == retry["prompt"]
        assert count_tries(handle, on=True) == [retry["prompt"]]   # the abandoned one never ran
    finally:
        release.touch()
        count_tries(handle, on=False)
        _scheduler_wait(api, GENERATE_WAIT_S, trainer)
        http.cancel(job.id)


def _post_and_hold(api, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST on a connection of its own, left open: closing it is the client going away."""
    where = urlsplit(api.url)
    connection = socket.create_connection((where.hostname, where.port), timeout=30)
    data = json.dumps(body).encode()
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {api.token}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


def test_a_try_it_whose_http_client_disconnects_while_queued_is_withdrawn_at_once_and_never_runs(api, tmp_path):
    http, job, trainer = _training(api, tmp_path, "left")
    _, handle = _scheduler_wait(api, GENERATE_WAIT_S, trainer)   # the service's own wait: far past this test
    marker, release = tmp_path / "trainer-busy", tmp_path / "trainer-free"
    try:
        assert count_tries(handle, on=True) == [] and tickets(api.ray) == []
        busy = hold_busy(handle, marker, HOLD_S, release)   # in the trainer's process
        wait_for(marker.exists, timeout=60, what="the trainer to be busy")
        left = {"prompt": "Q: left 1 and 3\nA:", "max_new_tokens": 4}
        connection = _post_and_hold(api, f"/v1/jobs/{job.id}/generate", left)
        (ticket,) = wait_for(lambda: tickets(api.ray), timeout=30, what="the \"try it\" to reach the scheduler")
        connection.close()   # the client goes away while its "try it" queues behind the trainer's call
        # withdrawn within seconds (the trainer still busy), not when the scheduler's 90 s wait ends
        wait_for(lambda: ticket not in tickets(api.ray), timeout=HOLD_S / 2, every=0.1,
                 what="the disconnected client's \"try it\" to be withdrawn")
        assert not ray.wait([busy], timeout=0)[0], "the trainer was free before the withdrawal was seen"
        release.touch()   # the trainer freed (not HOLD_S waited out)
        ray.get(busy, timeout=60)
        retry = {"prompt": "Q: stayed 1 and 3\nA:", "max_new_tokens": 4}
        answer = httpx.post(f"{api.url}/v1/jobs/{job.id}/generate", json=retry, headers=api.auth(), timeout=120)
        assert answer.status_code == 200, answer.text
        assert count_tries(handle, on=True) == [retry["prompt"]]   # the withdrawn one was dropped unrun
        # a withdrawal that overtakes its call (the two cross on their way): the call is refused when it comes
        early = uuid.uuid4().hex
        assert api.ray.withdraw_try(early) is False
        with pytest.raises(ValueError, match="withdrew this \"try it\" before it reached the scheduler"):
            api.ray.generate(job.id, "Q: early 1 and 3\nA:", 4, early)
        assert count_tries(handle, on=True) == [retry["prompt"]] and tickets(api.ray) == []
    finally:
        release.touch()
        count_tries(handle, on=False)
        http.cancel(job.id)


STEP_S = 0.2       # each decode step of a "try it", slowed in the trainer's process
MAX_TOKENS = 256   # ... to this many new tokens (no stop token): about 50 s uncut


def _slow_decoding(handle, folder: str | None) -> None:
    """In the trainer's process: with `folder`, each "try it" decodes to its max_new_tokens (no stop token), each
    decode step STEP_S slower and noted in folder/steps (a line each, as it runs: the trainer takes no other call
    meanwhile), and its end in folder/ended (its answer's new tokens, or its error's class); None undoes it all."""
    def run(actor, folder=folder, step_s=STEP_S):
        import actors.service.trainer.try_adapter as tries
        from actors.engine.generation_eval import stop_token_ids

        loop = actor.loop
        if folder is None:
            actor.__dict__.pop("slow_hook").remove()
            vars(loop).pop("try_prompt", None)
            tries.stop_token_ids = stop_token_ids
            return
        where, trying = Path(folder), []

        def slow(module, args, kwargs):
            if trying:
                time.sleep(step_s)
                with open(where / "steps", "a") as steps:
                    steps.write("step\n")

        actor.slow_hook = loop.base.decoder.register_forward_pre_hook(slow, with_kwargs=True)
        tries.stop_token_ids = lambda base: set()
        original = loop.try_prompt

        def slowly(*args, **kwargs):
            trying.append(True)
            try:
                answer = original(*args, **kwargs)
            except Exception as error:
                (where / "ended").write_text(type(error).__name__)
                raise
            finally:
                trying.clear()
            (where / "ended").write_text(str(answer["new_tokens"]))
            return answer

        loop.try_prompt = slowly

    ray.get(handle.__ray_call__.remote(run), timeout=120)


def test_a_try_it_whose_http_client_disconnects_while_generating_stops_and_the_trainer_trains_on(api, tmp_path):
    http, job, trainer = _training(api, tmp_path, "cut")
    _, handle = _scheduler_wait(api, GENERATE_WAIT_S, trainer)
    folder = tmp_path / "decoding"
    folder.mkdir()
    steps, ended = folder / "steps", folder / "ended"
    _slow_decoding(handle, str(folder))
    try:
        prompt = {"prompt": "Q: cut 1 and 3\nA:", "max_new_tokens": MAX_TOKENS}
        connection = _post_and_hold(api, f"/v1/jobs/{job.id}/generate", prompt)
        hang_up_while_decoding(connection, steps, ended, MAX_TOKENS)   # not after its MAX_TOKENS (about 50 s)
        assert tickets(api.ray) == []
        step = api.ray.status(job.id).step   # the trainer free again: the job trains on
        wait_for(lambda: api.ray.status(job.id).step >= step + 2, timeout=60, what="the job to train on",
                 state=lambda: api.ray.status(job.id))
    finally:
        _slow_decoding(handle, None)
        http.cancel(job.id)
