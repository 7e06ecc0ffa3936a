"""A request's blocking work raced against its client going away (`unless_gone`): the work runs in a worker thread
while the request's connection is looked at every `DISCONNECT_POLL_S`; a client that closed it is noticed then, not
when the work ends, and what it asked for is withdrawn at once (a "try it": its ticket, so that the trainer does not
run it or stops generating it; actors/service/scheduler/call_waits.py). The work's own end is still taken and
logged: nothing of it is lost unseen."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
CLIENT_CLOSED = 499   # the status logged for a request whose client went away (nobody reads it)


async def unless_gone(request: Request, work: Callable[[], Any], withdraw: Callable[[], Any], what: str) -> Any:
    """`work()`'s answer, run in a worker thread; where the client disconnects first, `withdraw()` (in a worker
    thread too) and an empty answer of status CLIENT_CLOSED. `what`: the request, as the log names it."""
    task = asyncio.ensure_future(run_in_threadpool(work))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            break
    log.info("aspen http: the client of %s disconnected before its answer; withdrawing it", what)
    task.add_done_callback(lambda ended: _ended_unread(ended, what))
    try:
        await run_in_threadpool(withdraw)
    except Exception as error:  # noqa: BLE001 - the client is gone: its withdrawal's failure is logged, not answered
        log.warning("aspen http: %s could not be withdrawn after its client disconnected (it runs to its end, and its "
                    "answer is dropped): %s", what, error)
    return Response(status_code=CLIENT_CLOSED)


def _ended_unread(task: asyncio.Future, what: str) -> None:
    """The end of a request's work whose client went away: logged (its answer has nobody to go to)."""
    error = task.exception()
    if error is None:
        log.info("aspen http: %s ended after its client disconnected; its answer was dropped", what)
    else:
        log.info("aspen http: %s ended after its client disconnected: %s", what, getattr(error, "detail", error))
