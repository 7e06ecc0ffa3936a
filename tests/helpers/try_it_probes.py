"""Probes of a "try it" on a real service, run in its actors' own processes: the tickets the scheduler waits for,
the prompts a trainer's loop ran, a trainer's handle and a call that keeps it busy (its one call at a time)."""

from __future__ import annotations

import time
from pathlib import Path

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


def hold_busy(handle, marker: Path, seconds: float):
    """The trainer kept busy `seconds` by a call in its own process (it takes one call at a time), once `marker`
    exists; the call's ObjectRef (ready when the trainer is free again)."""
    def hold(actor, marker=str(marker), seconds=seconds):
        Path(marker).touch()
        time.sleep(seconds)

    return handle.__ray_call__.remote(hold)
