"""Probes of a "try it" on a real service, run in its actors' own processes: the tickets the scheduler waits for,
the prompts a trainer's loop ran, a trainer's handle, a call that keeps it busy (its one call at a time), its
decoding slowed and noted step by step; and a request whose HTTP client can hang up."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import ray


def tickets(client) -> list[str]:
    """The "try it" tickets the scheduler of `client` (a Ray Client) waits for now."""
    def run(scheduler):
        with scheduler.fleet.tries.lock:
            return sorted(scheduler.fleet.tries.tickets)

    return ray.get(client.scheduler.__ray_call__.remote(run), timeout=60)


def trainer_handle(client, trainer: str):
    """The actor handle of `client`'s trainer `trainer` (its name as a job's record has it)."""
    def run(scheduler, trainer=trainer):
        return scheduler.fleet.handle_of(trainer)

    return ray.get(client.scheduler.__ray_call__.remote(run), timeout=60)


def count_tries(handle, on: bool) -> list[str]:
    """In the trainer's process: from `on`, each "try it" prompt its loop runs is noted; the prompts noted so far
    (and, `on` False, the noting ended)."""
    def run(actor, on=on):
        noted = actor.__dict__.setdefault("tries_noted", [])
        if on and "try_prompt" not in vars(actor.loop):
            original = actor.loop.try_prompt

            def noting(job_id, prompt, max_new_tokens, *args, **kwargs):
                noted.append(prompt)
                return original(job_id, prompt, max_new_tokens, *args, **kwargs)

            actor.loop.try_prompt = noting
        elif not on:
            vars(actor.loop).pop("try_prompt", None)
            actor.__dict__.pop("tries_noted")
        return list(noted)

    return ray.get(handle.__ray_call__.remote(run), timeout=120)


def hold_busy(handle, marker: Path, seconds: float, release: Path | None = None):
    """The trainer kept busy `seconds` by a call in its own process (it takes one call at a time), once `marker`
    exists, or until `release` exists (the test done with the trainer busy: it need not wait the rest out); the
    call's ObjectRef (ready when the trainer is free again)."""
    def hold(actor, marker=str(marker), seconds=seconds, release=str(release) if release else None):
        Path(marker).touch()
        until = time.monotonic() + seconds
        while time.monotonic() < until and not (release and Path(release).exists()):
            time.sleep(0.05)

    return handle.__ray_call__.remote(hold)


def post_and_hold(url: str, token: str, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST to the server at `url` on a connection of its own, left open: closing it is the client
    going away."""
    where = urlsplit(url)
    connection = socket.create_connection((where.hostname, where.port), timeout=30)
    data = json.dumps(body).encode()
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {token}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


def slow_decoding(handle, folder: str | None, step_s: float) -> None:
    """In the trainer's process (one device's or a pipeline's: its engine's `decode`): with `folder`, each "try it"
    decodes to its max_new_tokens (no stop token), each decode step `step_s` slower and noted in folder/steps (a
    line each, as it runs), and its end in folder/ended (its answer's new tokens, or its error's class); None undoes
    it all."""
    def run(actor, folder=folder, step_s=step_s):
        import actors.service.trainer.try_adapter as tries
        from actors.engine.generation_eval import stop_token_ids

        loop = actor.loop
        if folder is None:
            vars(loop.trainer).pop("decode", None)
            vars(loop).pop("try_prompt", None)
            tries.stop_token_ids = stop_token_ids
            return
        where, engine_decode, original = Path(folder), loop.trainer.decode, loop.try_prompt

        def decode(requests, choose, finished):
            def slow_choose(logits):
                time.sleep(step_s)
                with open(where / "steps", "a") as steps:
                    steps.write("step\n")
                return choose(logits)

            return engine_decode(requests, slow_choose, finished)

        def noted(*args, **kwargs):
            try:
                answer = original(*args, **kwargs)
            except Exception as error:
                (where / "ended").write_text(type(error).__name__)
                raise
            (where / "ended").write_text(str(answer["new_tokens"]))
            return answer

        tries.stop_token_ids = lambda base: set()
        loop.trainer.decode = decode
        loop.try_prompt = noted

    ray.get(handle.__ray_call__.remote(run), timeout=120)


def hang_up_while_decoding(connection: socket.socket, steps: Path, ended: Path, max_tokens: int) -> int:
    """Close `connection` (a "try it" held by `post_and_hold`) once `slow_decoding`'s `steps` file shows 3 decode
    steps, then check the generation stopped as withdrawn (`ended` says how it ended) well before its `max_tokens`
    (its ticket gone is the caller's to check): the decode steps it took."""
    from tests.helpers.service import wait_for

    wait_for(lambda: steps.exists() and len(steps.read_text().split()) >= 3, timeout=60,
             what="the \"try it\" to be generating")
    connection.close()   # the client goes away while its "try it" generates
    wait_for(ended.exists, timeout=10, every=0.1, what="the withdrawn generation to stop")
    assert ended.read_text() == "Withdrawn"
    decoded = len(steps.read_text().split())
    assert decoded < max_tokens // 4, decoded   # stopped between two decode steps, not after its max_tokens
    return decoded
