"""The HTTP API's job routes: submit (JSON or YAML, one job or a jobs file), list, one job, its losses,
transitions, spec, serving lines, "try it", its eval_generate generations, cancel / pause / resume, and its
adapter as a tar.gz."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any
from urllib.parse import urlencode

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from actors.checkpoint.adapter_export import ExportError
from actors.service.outputs.job_files import job_generations
from actors.service.table.job_record import page_cursor, parse_cursor
from actors.service.table.job_table import JOB_STATES, TERMINAL_STATES, JobRecord
from actors.spec.job_submission import JobSubmission
from orchestrator.export import FoundJob, adapter_archive
from orchestrator.http.callers import Caller, find_job, visible
from orchestrator.http.console import serving_answer, spec_answer
from orchestrator.http.data_rows import check_rows
from orchestrator.http.disconnects import unless_gone
from orchestrator.http.request_bodies import parse_body, submissions_from
from orchestrator.http.responses import QUOTA_REFUSAL, STORE_UNREACHABLE, ErrorBody, StrictJSONResponse
from orchestrator.http.routes import Routes, operation_route
from orchestrator.http.target_checks import check_targets
from orchestrator.operation_models import BudgetBody, GenerateBody, Submitted, Transition
from orchestrator.service_calls import call_service

UNFINISHED_STATES = tuple(state for state in JOB_STATES if state not in TERMINAL_STATES)
STATE_FILTER = f"only jobs in these states: {', '.join(JOB_STATES)}"
JOBS_PAGE, MAX_JOBS_PAGE = 1000, 10_000   # GET /v1/jobs: jobs per page by default, and at most


def _one_job(data: Any) -> bool:
    """Whether the body is one job's fields (not a jobs file with `jobs: [...]`)."""
    return not (isinstance(data, dict) and "jobs" in data)


def add_job_routes(api: APIRouter, ctx: Routes) -> None:
    """Submit jobs (a jobs file's, or one job's fields)."""
    link, require_token, audited = ctx.link, ctx.require_token, ctx.audited
    submit_lock, parsers, body_schema, row_checks = ctx.submit_lock, ctx.parsers, ctx.body_schema, ctx.row_checks

    @operation_route(api, "submit", status_code=201, tags=["jobs"],
              responses={413: {"model": ErrorBody, "description": "the body is too large"},
                         415: {"model": ErrorBody, "description": "the body is neither JSON nor YAML"},
                         422: {"model": ErrorBody, "description": "malformed body, invalid spec, a "
                                                                  "lora.target_modules name its base has no layer "
                                                                  "of, or a data row that does not fit its job's "
                                                                  "format; `errors` names each field (and row)"},
                         **QUOTA_REFUSAL, **STORE_UNREACHABLE},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": body_schema},
                  "application/yaml": {"schema": {"type": "string", "description": "a jobs file, or one job's "
                                                                                   "fields, as YAML text"}}}}})
    async def submit(request: Request, caller: Caller = Depends(require_token)) -> Any:
        """Submit one job (its fields, with base_model, quantization, dtype and output_dir beside them) or
        every job of a jobs file (`jobs: [...]`), all or none. Paths are the service's machine's: data as an
        absolute path or a storage URI. A name that an unfinished job holds is refused (409), so that the
        name keeps naming one job. Each job's data rows are read and tokenized as `aspen submit` reads them (a
        local file whole, the first 1000 rows of a storage URI or a stream): a row that does not fit its job's
        format is refused (422) with its job, row and field; so is a `lora.target_modules` name its base (where this
        machine has it) has no linear layer of, with the nearest name and the base's names. A batch its user's quota
        of queued jobs or daily tokens does not allow now is refused 429 with Retry-After, nothing entered."""
        # off the event loop (the API answers meanwhile), at most PARSE_THREADS at once, within BODY_LIMITS
        data, text = await anyio.to_thread.run_sync(parse_body, await request.body(),
                                                    request.headers.get("content-type"), limiter=parsers)

        def refuse_held(client: Any, submissions: list[JobSubmission]) -> None:
            names = {s.job.name for s in submissions}
            held = [r for r in client.jobs(UNFINISHED_STATES) if r.name in names]
            if held:   # another user's job is not described: only that its name is taken
                own = all(caller.sees(r.user) for r in held)
                raise HTTPException(409, "; ".join(f"job '{r.name}' is already {r.state} as {r.id}"
                                                   if caller.sees(r.user) else
                                                   f"job name '{r.name}' is held by another user's unfinished job"
                                                   for r in held)
                                    + ("; cancel it, wait for it to end, or choose another name" if own else
                                       "; choose another name (or wait for that job to end)"))

        def parsed(client: Any) -> list[JobSubmission]:
            return [submission.model_copy(update={"user": caller.owner}) for submission in
                    submissions_from(data, text=text, output_root=client.info().get("output_root"),
                                     check_files=caller.admin)]

        def checked(client: Any) -> None:
            refuse_held(client, submissions)        # a taken name is told before the rows are read
            client.check_submissions(submissions)   # where the caller may read, before anything is read

        submissions = await run_in_threadpool(call_service, link, parsed)
        # each lora.target_modules name against its base's layers, located in the body (the service knows only the
        # bases its trainers hold, and names no field); seconds where the base is built on meta: off the event loop
        await anyio.to_thread.run_sync(partial(check_targets, submissions, single_job=_one_job(data), text=text),
                                       limiter=row_checks)
        await run_in_threadpool(call_service, link, checked)
        # the rows, as `aspen submit` reads them (off the event loop, at most ROW_CHECK_THREADS at once)
        await anyio.to_thread.run_sync(partial(check_rows, submissions, single_job=_one_job(data), text=text),
                                       limiter=row_checks)

        def enter(client: Any) -> list[JobRecord]:
            with submit_lock:
                refuse_held(client, submissions)
                records = client.submit_records(submissions)
            for record in records:
                audited(caller, "job.submit", record.id, name=record.name)
            return records

        records = await run_in_threadpool(call_service, link, enter)
        headers = {"Location": f"/v1/jobs/{records[0].id}"} if len(records) == 1 else None
        return StrictJSONResponse(Submitted(jobs=records).model_dump(mode="json"), status_code=201, headers=headers)



def add_job_reading_routes(api: APIRouter, ctx: Routes) -> None:
    """Your jobs (in pages), one job's record, its loss rows and its transitions."""
    link, require_token = ctx.link, ctx.require_token

    @operation_route(api, "jobs", tags=["jobs"])
    def jobs(response: Response, state: list[str] | None = Query(None, description=STATE_FILTER),
             limit: int = Query(JOBS_PAGE, ge=1, le=MAX_JOBS_PAGE, description="at most this many jobs (a page)"),
             after: str | None = Query(None, description="the jobs after this cursor: the `after` of the previous "
                                                         "page's next link (`<submitted_at>,<job id>`)"),
             caller: Caller = Depends(require_token)) -> Any:
        """Your jobs (an admin: everyone's), oldest first, or those in the given states (`?state=queued&state=running`),
        a page of at most `limit` (default 1000); where more follow, a `Link: <...>; rel="next"` header gives the
        next page's URL (its `after`: the last job's `<submitted_at>,<id>`). Pages cover every job once, jobs
        submitted meanwhile on the last."""
        unknown = sorted(set(state or ()) - set(JOB_STATES))
        if unknown:
            raise HTTPException(422, f"unknown job states {unknown}; the states are {', '.join(JOB_STATES)}")
        cursor = None
        if after is not None:
            try:
                parse_cursor(after)
            except ValueError as error:
                raise HTTPException(422, str(error)) from None
            cursor = after
        owner = None if caller.admin else caller.name   # a user's jobs only, chosen by the table's query
        records = visible(call_service(link, lambda client: client.jobs(state or None, limit + 1, cursor, owner)),
                          caller)
        if len(records) > limit:
            records = records[:limit]
            query = [("limit", str(limit)), ("after", page_cursor(records[-1])), *(("state", s) for s in state or ())]
            response.headers["Link"] = f'</v1/jobs?{urlencode(query)}>; rel="next"'
        return records

    @operation_route(api, "status", tags=["jobs"])
    def status(job: str, caller: Caller = Depends(require_token)) -> Any:
        """One job of yours, by id or by a name that only one of your jobs has."""
        return call_service(link, lambda client: find_job(client, caller, job))

    @operation_route(api, "losses", tags=["jobs"])
    def losses(job: str, caller: Caller = Depends(require_token)) -> Any:
        """One row per optimizer step: step, loss, tokens, lr, grad_norm, eval_loss and eval_score (where
        evaluated), time, and the job's method's metrics (a GRPO job's rewards, a preference job's margins)."""
        return call_service(link, lambda client: client.losses(find_job(client, caller, job).id))

    @operation_route(api, "transitions", tags=["jobs"])
    def transitions(job: str, caller: Caller = Depends(require_token)) -> Any:
        """The job's state history, oldest first."""
        rows = call_service(link, lambda client: client.transitions(find_job(client, caller, job).id))
        return [Transition(time=when, state=state, reason=reason) for when, state, reason in rows]



def add_job_detail_routes(api: APIRouter, ctx: Routes) -> None:
    """A job's spec, serving lines, "try it", its evaluations' generations."""
    link, require_token, audited = ctx.link, ctx.require_token, ctx.audited

    @operation_route(api, "spec", tags=["jobs"])
    def job_spec(job: str, caller: Caller = Depends(require_token)) -> Any:
        """The job's spec as a jobs file that submits it again (`yaml`: its text, `jobs_file`: its data); its
        output folder is left out (a clone gets its own)."""
        return call_service(link, lambda client: spec_answer(client.submission(find_job(client, caller, job).id)))

    @operation_route(api, "serving", tags=["jobs"],
             responses={409: {"model": ErrorBody, "description": "the job's base is not on the service's machine"}})
    def serving(job: str, caller: Caller = Depends(require_token)) -> Any:
        """The lines that serve the job's adapter with vLLM and load it with PEFT, naming the base where the
        service's machine has it (`vllm`: null where vLLM cannot serve it; `elsewhere`: what to change on
        another machine; `written`: whether the adapter is in its folder yet)."""
        def run(client: Any) -> dict[str, Any]:
            record = find_job(client, caller, job)
            return record, client.submission(record.id)

        record, submission = call_service(link, run)
        try:
            return serving_answer(record, submission)
        except (OSError, ValueError) as error:
            raise HTTPException(409, f"the lines for '{record.name}' name its base where this machine has it, "
                                     f"and it has not: {error}") from None

    @operation_route(api, "generate", tags=["jobs"],
                     responses={503: {"model": ErrorBody, "description": "its trainer stayed busy (a step, another "
                                                                         "generation) past the service's wait, or "
                                                                         "the service does not answer; Retry-After"}})
    async def generate(job: str, body: GenerateBody, request: Request, caller: Caller = Depends(require_token)) -> Any:
        """"Try it": the prompt continued greedily by the job's adapter and by the base model alone, on a trainer
        between two steps (the steps wait meanwhile): a running job's current adapter on its trainer, a completed or
        early-stopped job's final one on a trainer holding its base. 409 for a job with neither (queued, paused,
        failed, cancelled) or whose base no trainer holds now; 503 with Retry-After where the trainer has not
        answered within GENERATE_WAIT_S (90 s: busy with a step or another generation). A client that disconnects
        first withdraws it: its trainer does not run it, or stops generating it."""
        ticket = uuid.uuid4().hex

        def run(client: Any) -> dict[str, Any]:
            record = find_job(client, caller, job)
            answer = client.generate(record.id, body.prompt, body.max_new_tokens, ticket)
            audited(caller, "job.generate", record.id, name=record.name)
            return answer

        return await unless_gone(request, partial(call_service, link, run),
                                 partial(call_service, link, lambda client: client.withdraw_try(ticket)),
                                 f"the \"try it\" of job {job}")

    @operation_route(api, "generations", tags=["jobs"],
             responses={404: {"model": ErrorBody, "description": "no such job, or no evaluation after that step"}})
    def generations(job: str, step: int | None = Query(None, description="the evaluation after this step "
                                                                           "(default: the last)"),
                    caller: Caller = Depends(require_token)) -> Any:
        """A job's eval_generate evaluation (the last, or the one after `step`): each scored eval row's prompt,
        reference, the adapter's greedy prediction and its score, and every evaluated step (`steps`; empty for a
        job without eval_generate, or not evaluated yet)."""
        record = call_service(link, lambda client: find_job(client, caller, job))
        try:
            return job_generations(record, step)
        except ValueError as error:
            raise HTTPException(404, str(error)) from None
        except OSError as error:   # a storage URI that does not answer (StorageError), a folder it cannot read
            raise HTTPException(503, f"the generations of '{record.name}' in {record.output_dir} cannot be read: "
                                     f"{error}") from None



def add_job_verb_routes(api: APIRouter, ctx: Routes) -> None:
    """The verbs that change a job's state (cancel, pause, resume) and its adapter's export."""
    link, require_token, audited = ctx.link, ctx.require_token, ctx.audited

    def job_verb(verb: str, what: str, responses: dict | None = None) -> None:
        def act(job: str, caller: Caller = Depends(require_token)) -> Any:
            def run(client: Any) -> JobRecord:
                record = find_job(client, caller, job)
                after = getattr(client, verb)(record.id)
                audited(caller, f"job.{verb}", record.id, name=record.name)
                return after

            return call_service(link, run)

        act.__name__ = verb
        act.__doc__ = what
        operation_route(api, verb, tags=["jobs"], responses=responses or {})(act)

    job_verb("cancel", "Cancel a queued, running or paused job (a running one is checkpointed at its next step); "
                       "409 for a job that has ended.")
    job_verb("pause", "Pause a queued or running job (checkpointed; /resume continues it).")
    job_verb("resume", "Queue a paused, failed or cancelled job again; it continues from its last checkpoint. 429 "
                       "with Retry-After where its user's queued quota or daily tokens do not allow it now, 422 where "
                       "their data roots or allowed functions do not.", QUOTA_REFUSAL)

    @operation_route(api, "export", response_class=Response, tags=["jobs"],
             responses={200: {"content": {"application/gzip": {}}, "description": "the PEFT folder's files, tar.gz"},
                        409: {"model": ErrorBody, "description": "the job has no adapter to export (yet)"}})
    def adapter(job: str, checkpoint: bool = Query(False, description="its last checkpoint instead of its final "
                                                                      "adapter (a job still training)"),
                caller: Caller = Depends(require_token)) -> Response:
        """The job's adapter as `aspen export` writes it (a PEFT folder for vLLM's --lora-modules or PEFT:
        adapter_config.json naming the base, adapter_model.safetensors, aspen.json), as a gzipped tar of
        those files; `aspen export JOB --url` unpacks it. 409 where the job has none yet, saying why."""
        record = call_service(link, lambda client: find_job(client, caller, job))
        found = FoundJob(record.name, record.output_dir, record.state, record.step, record.total_steps)
        try:
            archive = adapter_archive(found, checkpoint=checkpoint)
        except (ExportError, FileNotFoundError) as error:
            raise HTTPException(409, str(error)) from None
        audited(caller, "job.export", record.id, name=record.name, checkpoint=checkpoint)
        name = f"{record.name}-{'checkpoint' if checkpoint else 'lora'}.tar.gz"
        return Response(archive, media_type="application/gzip",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})


def add_job_budget_routes(api: APIRouter, ctx: Routes) -> None:
    """Raising an ended or paused job's budget."""
    link, require_token, audited = ctx.link, ctx.require_token, ctx.audited

    @operation_route(api, "raise_budget", tags=["jobs"], responses=QUOTA_REFUSAL)
    def extend(job: str, body: BudgetBody, caller: Caller = Depends(require_token)) -> Any:
        """Continue an ended (completed, stopped early, failed, cancelled) or paused job to a larger max_steps, epochs
        or both: it is queued again and trains on from its last checkpoint (a raised epochs: into its next epoch).
        409 for a running or queued job, a budget not above its own, one that would train nothing (a job its epochs
        ended given a larger max_steps alone, one its max_steps ended a larger epochs alone), epochs added to a job
        that had none, an interactive model; 429 with Retry-After where its user's queued quota or daily tokens do not
        allow it now, 422 where their data roots or allowed functions do not."""
        def run(client: Any) -> JobRecord:
            record = find_job(client, caller, job)
            after = client.raise_budget(record.id, body.max_steps, body.epochs)
            audited(caller, "job.extend", record.id, name=record.name, max_steps=body.max_steps, epochs=body.epochs)
            return after

        return call_service(link, run)
