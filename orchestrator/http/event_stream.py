"""The HTTP API's event stream (server-sent events): a snapshot, then every job state change by its number
in the job table (a client that reconnects with Last-Event-ID gets every one since), steps with
?progress=true, and an `error` event while the service does not answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from actors.service.table.job_table import JobRecord
from orchestrator.http.callers import Caller, find_job, visible
from orchestrator.http.routes import Routes, operation_route
from orchestrator.service_calls import call_service

EVENTS_BATCH = 500           # transitions per poll at most (a backlog is sent in batches without waiting)


@dataclass(frozen=True)
class EventStart:
    """Where an event stream starts: its job (None: every job), the transition number it follows, and the
    jobs of its snapshot (None when it resumes after a Last-Event-ID)."""

    job: str | None
    after: int
    records: list[JobRecord] | None


def add_event_routes(api: APIRouter, ctx: Routes) -> None:
    link, require_token, events_poll_s = ctx.link, ctx.require_token, ctx.events_poll_s

    def event_start(job: str | None = Query(None, description="only this job (id or name)"),
                    last_event_id: str | None = Header(None, description="resume after this event (the `id` of the "
                                                                         "last event received)"),
                    caller: Caller = Depends(require_token)) -> EventStart:
        """Where a stream starts, checked before it opens (an unknown job is a 404, a service that does not
        answer a 503, not an event)."""
        if last_event_id is not None and not last_event_id.strip().isdigit():
            raise HTTPException(422, f"Last-Event-ID {last_event_id!r} is not an event id of this stream (a whole "
                                     "number)")
        key = call_service(link, lambda client: find_job(client, caller, job).id) if job else None
        if last_event_id is not None:
            return EventStart(key, int(last_event_id), None)
        after, _ = call_service(link, lambda client: client.transitions_after(None))
        return EventStart(key, after, call_service(link, lambda client: client.jobs()))   # after `after`: none missed

    @operation_route(api, "events", response_class=EventSourceResponse, tags=["events"])
    async def events(request: Request, start: EventStart = Depends(event_start),
                     progress: bool = Query(False, description="also an event per optimizer step of running jobs"),
                     caller: Caller = Depends(require_token)) -> AsyncIterator[ServerSentEvent]:
        """Server-sent events. Without Last-Event-ID first a `snapshot` (every job), then a `transition` per
        job state change (`id`: its number in the job table; reconnecting with Last-Event-ID sends every
        transition since), `progress` per step with ?progress=true, and `error` while the service does not
        answer (the stream stays open and goes on when it answers again)."""
        key, after = start.job, start.after
        states = {r.id: r.state for r in start.records or ()}
        steps = {r.id: r.step for r in start.records or ()}
        owners = {r.id: r.user for r in start.records or ()}   # a user's stream carries their own jobs only
        if start.records is not None:
            shown = [r for r in visible(start.records, caller) if key in (None, r.id)]
            yield ServerSentEvent(event="snapshot", id=str(after), data={"jobs": shown, "seq": after})
        failing = False
        while not await request.is_disconnected():
            try:
                _, rows = await run_in_threadpool(call_service, link, lambda client,
                                                  after=after: client.transitions_after(after,
                                                                                                      EVENTS_BATCH))
                running = await run_in_threadpool(call_service, link, lambda client: client.jobs(("running",))) \
                    if progress else []
            except HTTPException as error:
                if not failing:
                    yield ServerSentEvent(event="error", data={"detail": error.detail})
                failing = True
                await asyncio.sleep(max(events_poll_s, 1.0))
                continue
            if failing:
                yield ServerSentEvent(event="error", data={"detail": None, "recovered": True})
                failing = False
            if not caller.admin and any(row["job"] not in owners for row in rows):   # jobs new to this stream
                try:
                    listing = await run_in_threadpool(call_service, link, lambda client: client.jobs())
                except HTTPException:
                    await asyncio.sleep(max(events_poll_s, 1.0))
                    continue   # the same rows again next time (`after` has not moved)
                owners.update({r.id: r.user for r in listing})
            for row in rows:
                after = row["seq"]
                previous = states.get(row["job"])
                states[row["job"]] = row["state"]
                if key in (None, row["job"]) and caller.sees(owners.get(row["job"])):
                    yield ServerSentEvent(event="transition", id=str(row["seq"]), data={**row, "previous": previous})
            for record in running:
                if key in (None, record.id) and caller.sees(record.user) and steps.get(record.id) != record.step:
                    steps[record.id] = record.step
                    yield ServerSentEvent(event="progress", data={
                        "job": record.id, "name": record.name, "step": record.step, "total_steps": record.total_steps,
                        "loss": record.loss, "eval_loss": record.eval_loss, "eval_score": record.eval_score,
                        "tokens": record.tokens, "tokens_per_s": record.tokens_per_s, "time": record.updated_at})
            if len(rows) < EVENTS_BATCH:
                await asyncio.sleep(events_poll_s)
