"""How long a "try it" is waited for, at each hop, each wait derived from the one it waits on, so that the
service's own answer (a result, or that the trainer was busy) reaches its caller before the caller gives up:

- the scheduler waits `GENERATE_WAIT_S` for the trainer to take the call (after its current step) and generate;
  a trainer that has not answered by then is busy, and the caller is told so (`TrainerBusy`). The call is then
  withdrawn (`WaitedTries`): the trainer, taking it from its queue, first asks the scheduler whether it is still
  waited for, and drops it unrun where not, so an abandoned "try it" neither takes the trainer's time nor holds up
  the caller's retry (Ray's own `ray.cancel` does not stop a queued call of a trainer: it runs all the same);
- a caller that stops waiting sooner (the HTTP API's client disconnected) withdraws its ticket itself
  (`SchedulerActor.withdraw_try`): the scheduler's wait ends at once, a trainer that has not run the call drops it,
  and one generating it stops at its next look at the ticket (every `TICKET_WATCH_S`, between decode steps);
- the Ray client waits `SCHEDULER_CALL_WAIT_S` for any scheduler call (orchestrator/client.py), the longest of
  which is a "try it";
- the HTTP server waits longer for its Ray connection's process (orchestrator/http/bridge.py: CALL_TIMEOUT_S),
  and the HTTP client longer again (orchestrator/http/api_client.py)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

GENERATE_WAIT_S = 90.0   # a "try it" waits for the trainer's current step, then for its generation
SCHEDULER_CALL_WAIT_S = GENERATE_WAIT_S + 30.0   # the longest scheduler call, plus its lock and the hops
BUSY_RETRY_AFTER_S = 30   # what a busy trainer's answer suggests (HTTP: its Retry-After)
TICKET_ASK_S = 10.0       # how long a trainer waits for the scheduler's word on a "try it" ticket
TICKET_WATCH_S = 0.5      # how often a trainer generating a "try it" asks whether it is still waited for
WITHDRAW_POLL_S = 0.1     # how often the scheduler's wait for a trainer looks whether its caller withdrew
EARLY_WITHDRAWALS = 1024  # tickets withdrawn before their call arrived, remembered (the oldest forgotten first)


class WaitedTries:
    """The "try it" calls the scheduler still waits for, each by its ticket (sent to the trainer with the call), and
    each one's withdrawal (`withdraw`: its caller stopped waiting). A ticket withdrawn before its call arrived (the
    two cross on their way) is remembered, and that call is refused when it comes. Thread-safe: the scheduler
    answers the trainers' questions (`waited`) and the withdrawals while its calls wait."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tickets: dict[str, threading.Event] = {}    # ticket -> set once withdrawn
        self.early: OrderedDict[str, None] = OrderedDict()

    def open(self, ticket: str | None = None) -> str:
        """A ticket for a call (`ticket`: the caller's own, to withdraw it by); `Withdrawn` where the caller
        withdrew it already, ValueError where a call waited for holds it."""
        ticket = ticket or uuid.uuid4().hex
        with self.lock:
            if ticket in self.early:
                del self.early[ticket]
                raise Withdrawn("its caller withdrew this \"try it\" before it reached the scheduler; not run")
            if ticket in self.tickets:
                raise ValueError(f"the \"try it\" ticket {ticket} is already in use; send the request without it")
            self.tickets[ticket] = threading.Event()
        return ticket

    def close(self, ticket: str) -> None:
        """The call is answered, or given up on: a trainer that has not run it yet will not."""
        with self.lock:
            self.tickets.pop(ticket, None)

    def withdraw(self, ticket: str) -> bool:
        """Its caller no longer waits: the scheduler's wait ends, the trainer drops it (or stops generating it).
        Whether a call held it (False: none yet, and the one that comes is refused; or it was answered already)."""
        with self.lock:
            withdrawn = self.tickets.pop(ticket, None)
            if withdrawn is None:
                self.early[ticket] = None
                while len(self.early) > EARLY_WITHDRAWALS:
                    self.early.popitem(last=False)
                return False
        withdrawn.set()
        return True

    def withdrawn(self, ticket: str) -> threading.Event:
        """Set once `ticket` is withdrawn (an event already set for a ticket not held)."""
        with self.lock:
            event = self.tickets.get(ticket)
        if event is None:
            event = threading.Event()
            event.set()
        return event

    def waited(self, ticket: str) -> bool:
        with self.lock:
            return ticket in self.tickets


def wait_unless_withdrawn(call: Any, withdrawn: threading.Event, seconds: float) -> Any:
    """`call`'s answer (a `TrainerCall`: `done`, `result`) within `seconds`, unless `withdrawn` is set first
    (`Withdrawn`); a call not done by then raises as its `result(timeout=0)` does (a timeout)."""
    deadline = time.monotonic() + seconds
    while not call.done():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if withdrawn.wait(min(WITHDRAW_POLL_S, left)):
            raise Withdrawn("its caller withdrew this \"try it\" (it stopped waiting for the answer)")
    return call.result(timeout=max(deadline - time.monotonic(), 0.0))


class Withdrawn(ValueError):
    """A "try it" nobody waits for any more (the scheduler gave up, or its caller withdrew it): not run, or its
    generation stopped where the trainer saw it."""


class TrainerBusy(TimeoutError):
    """A "try it" its trainer did not answer within `GENERATE_WAIT_S`: busy with a training step or another
    generation. The message says how long was waited and what to do."""


def busy_message(where: str, waited_s: float) -> str:
    return (f"{where} is busy with a training step or another generation: it did not answer this \"try it\" "
            f"within {waited_s:.0f} s (the service's wait), so the request was withdrawn from it (it will not hold "
            f"up yours); try again in {BUSY_RETRY_AFTER_S} s or later (a smaller max_new_tokens answers sooner)")
