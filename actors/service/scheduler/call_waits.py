"""How long a "try it" is waited for, at each hop, each wait derived from the one it waits on, so that the
service's own answer (a result, or that the trainer was busy) reaches its caller before the caller gives up:

- the scheduler waits `GENERATE_WAIT_S` for the trainer to take the call (after its current step) and generate;
  a trainer that has not answered by then is busy, and the caller is told so (`TrainerBusy`). The call is then
  withdrawn (`WaitedTries`): the trainer, taking it from its queue, first asks the scheduler whether it is still
  waited for, and drops it unrun where not, so an abandoned "try it" neither takes the trainer's time nor holds up
  the caller's retry (Ray's own `ray.cancel` does not stop a queued call of a trainer: it runs all the same);
- the Ray client waits `SCHEDULER_CALL_WAIT_S` for any scheduler call (orchestrator/client.py), the longest of
  which is a "try it";
- the HTTP server waits longer for its Ray connection's process (orchestrator/http/bridge.py: CALL_TIMEOUT_S),
  and the HTTP client longer again (orchestrator/http/api_client.py)."""

from __future__ import annotations

import threading
import uuid

GENERATE_WAIT_S = 90.0   # a "try it" waits for the trainer's current step, then for its generation
SCHEDULER_CALL_WAIT_S = GENERATE_WAIT_S + 30.0   # the longest scheduler call, plus its lock and the hops
BUSY_RETRY_AFTER_S = 30   # what a busy trainer's answer suggests (HTTP: its Retry-After)
TICKET_ASK_S = 10.0       # how long a trainer waits for the scheduler's word on a "try it" ticket


class WaitedTries:
    """The "try it" calls the scheduler still waits for, each by its ticket (sent to the trainer with the call).
    Thread-safe: the scheduler answers the trainers' questions (`waited`) while its calls wait."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tickets: set[str] = set()

    def open(self) -> str:
        ticket = uuid.uuid4().hex
        with self.lock:
            self.tickets.add(ticket)
        return ticket

    def close(self, ticket: str) -> None:
        """The call is answered, or given up on: a trainer that has not run it yet will not."""
        with self.lock:
            self.tickets.discard(ticket)

    def waited(self, ticket: str) -> bool:
        with self.lock:
            return ticket in self.tickets


class Withdrawn(ValueError):
    """A "try it" its trainer took from its queue after the scheduler gave up waiting for it: not run."""


class TrainerBusy(TimeoutError):
    """A "try it" its trainer did not answer within `GENERATE_WAIT_S`: busy with a training step or another
    generation. The message says how long was waited and what to do."""


def busy_message(where: str, waited_s: float) -> str:
    return (f"{where} is busy with a training step or another generation: it did not answer this \"try it\" "
            f"within {waited_s:.0f} s (the service's wait), so the request was withdrawn from it (it will not hold "
            f"up yours); try again in {BUSY_RETRY_AFTER_S} s or later (a smaller max_new_tokens answers sooner)")
