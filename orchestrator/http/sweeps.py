"""The HTTP API's sweep routes: start one (a sweep file as JSON or YAML), list, one sweep, cancel."""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from actors.spec.sweep_spec import SweepSpec
from orchestrator.http.callers import Caller, find_sweep
from orchestrator.http.data_rows import check_sweep_rows
from orchestrator.http.request_bodies import Refused, parse_body
from orchestrator.http.responses import QUOTA_REFUSAL, STORE_UNREACHABLE, ErrorBody, StrictJSONResponse
from orchestrator.http.routes import Routes, operation_route
from orchestrator.http.target_checks import check_sweep_targets
from orchestrator.jobs_file import SpecError
from orchestrator.service_calls import call_service


def add_sweep_routes(api: APIRouter, ctx: Routes) -> None:
    link, require_token, audited, parsers = ctx.link, ctx.require_token, ctx.audited, ctx.parsers

    @operation_route(api, "sweep", status_code=201, tags=["sweeps"],
              responses={422: {"model": ErrorBody, "description": "an invalid sweep, or a row of its data that "
                                                                  "does not fit its job's format; `detail` names "
                                                                  "each field"},
                         409: {"model": ErrorBody, "description": "a sweep of that name with other settings"},
                         **QUOTA_REFUSAL, **STORE_UNREACHABLE})
    async def submit_sweep(request: Request, caller: Caller = Depends(require_token)) -> Any:
        """Start a sweep (a sweep file as JSON or YAML: docs/sweeps.md; data and output_dir absolute paths on
        the service's machine). The service runs it from now on; 201 with its status. The same sweep sent
        again answers with it (nothing new starts). Its job's data rows are read and tokenized as `aspen submit`
        reads a job's (a local file whole, the first 1000 rows of a storage URI or a stream), under each combination
        of the space's values that changes how they read (max_seq_len, eval_split, ...): a row that does not fit the
        job's format is refused (422) with its row and field (a space value's: `space.<field>` and `settings`), as is a
        `lora.target_modules` name (the job's, or an option of the space's) its base has no linear layer of,
        before any trial is entered. A sweep whose first trial its user's quota refuses now is refused as that job
        is (429 with Retry-After); a later trial the quota refuses waits (the status's `waiting` says why)."""
        data, text = await anyio.to_thread.run_sync(parse_body, await request.body(),
                                                    request.headers.get("content-type"), limiter=parsers)

        def parsed() -> SweepSpec:
            from orchestrator.sweep import sweep_spec_from

            try:
                spec = sweep_spec_from(data, source="request", base_dir=None)
            except SpecError as error:
                raise Refused(422, f"nothing was started:\n{error}") from None
            if spec.user not in (None, caller.name) and not caller.admin:
                raise Refused(422, f"user: you submit as {caller.name}; leave user out (nothing was started)")
            # its lora.target_modules (the job's, the space's options) against its base's layers, each located
            check_sweep_targets(spec, text)
            return spec.model_copy(update={"user": spec.user or caller.owner})

        def checked(client: Any) -> tuple[SweepSpec, bool]:
            refuse_held(client, spec)
            return spec, client.check_sweep(spec)   # where the caller may read, before a row is read

        def refuse_held(client: Any, spec: SweepSpec) -> None:
            held = [s for s in client.sweeps() if s["name"] == spec.name and not caller.sees(s.get("user"))]
            if held:
                raise Refused(409, f"sweep name '{spec.name}' is held by another user's sweep; choose another name")

        # off the event loop (its base may be built on meta: seconds), ROW_CHECK_THREADS at once
        spec = await anyio.to_thread.run_sync(parsed, limiter=ctx.row_checks)
        spec, new = await run_in_threadpool(call_service, link, checked)
        if new:   # its job's rows, as `aspen submit` reads a job's (off the event loop, ROW_CHECK_THREADS at once)
            await anyio.to_thread.run_sync(partial(check_sweep_rows, spec, text), limiter=ctx.row_checks)

        def start(client: Any) -> dict[str, Any]:
            refuse_held(client, spec)
            status = client.sweep(spec, False)   # check_rows off: its rows were read above (the bridge: positional)
            audited(caller, "sweep.submit", spec.name)
            return status

        status = await run_in_threadpool(call_service, link, start)
        return StrictJSONResponse(status, status_code=201, headers={"Location": f"/v1/sweeps/{status['name']}"})

    @operation_route(api, "sweeps", tags=["sweeps"])
    def sweeps(caller: Caller = Depends(require_token)) -> Any:
        """Every sweep of yours (an admin: everyone's) with its leaderboard."""
        return [s for s in call_service(link, lambda client: client.sweeps()) if caller.sees(s.get("user"))]

    @operation_route(api, "sweep_status", tags=["sweeps"])
    def sweep_status(name: str, caller: Caller = Depends(require_token)) -> Any:
        """One sweep of yours: state (running, done, cancelled, failed), its trials (settings, state, objective,
        steps, why stopped), the best trial."""
        return call_service(link, lambda client: find_sweep(client, caller, name))

    @operation_route(api, "cancel_sweep", tags=["sweeps"])
    def cancel_sweep(name: str, caller: Caller = Depends(require_token)) -> Any:
        """Start no more trials of the sweep and cancel its running ones."""
        def run(client: Any) -> dict[str, Any]:
            find_sweep(client, caller, name)
            status = client.cancel_sweep(name)
            audited(caller, "sweep.cancel", name)
            return status

        return call_service(link, run)
