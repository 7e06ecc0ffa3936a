"""How long a "try it" is waited for, at each hop, each wait derived from the one it waits on, so that the
service's own answer (a result, or that the trainer was busy) reaches its caller before the caller gives up:

- the scheduler waits `GENERATE_WAIT_S` for the trainer to take the call (after its current step) and generate;
  a trainer that has not answered by then is busy, and the caller is told so (`TrainerBusy`);
- the Ray client waits `SCHEDULER_CALL_WAIT_S` for any scheduler call (orchestrator/client.py), the longest of
  which is a "try it";
- the HTTP server waits longer for its Ray connection's process (orchestrator/http/bridge.py: CALL_TIMEOUT_S),
  and the HTTP client longer again (orchestrator/http/api_client.py)."""

from __future__ import annotations

GENERATE_WAIT_S = 90.0   # a "try it" waits for the trainer's current step, then for its generation
SCHEDULER_CALL_WAIT_S = GENERATE_WAIT_S + 30.0   # the longest scheduler call, plus its lock and the hops
BUSY_RETRY_AFTER_S = 30   # what a busy trainer's answer suggests (HTTP: its Retry-After)


class TrainerBusy(TimeoutError):
    """A "try it" its trainer did not answer within `GENERATE_WAIT_S`: busy with a training step or another
    generation. The message says how long was waited and what to do."""


def busy_message(where: str, waited_s: float) -> str:
    return (f"{where} is busy with a training step or another generation: it did not answer this \"try it\" "
            f"within {waited_s:.0f} s (the service's wait); try again in {BUSY_RETRY_AFTER_S} s or later (a "
            "smaller max_new_tokens answers sooner)")
