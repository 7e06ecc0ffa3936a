"""The HTTP API next to the Ray client (FastAPI, run by uvicorn; `aspen http`): submit, list, follow and
cancel jobs without being a Ray driver. The app answers over the Ray client's calls through a `link`:
`aspen http` keeps the Ray connection in a child process (`orchestrator.http_bridge.ProcessLink`, so that
the server outlives a Ray cluster that goes away); `ServiceLink` (orchestrator/service_calls.py) calls a
client in this process.

    POST /v1/jobs                 a job spec (JSON or YAML): 201 with the entered jobs
    GET  /v1/jobs[?state=...]     every job (or those in the given states)
    GET  /v1/jobs/{job}           one job (by id, or by a name only one job has)
    POST /v1/jobs/{job}/cancel    also /pause and /resume: the job's record after it
    GET  /v1/jobs/{job}/losses    one row per optimizer step (step, loss, tokens, lr, grad_norm, eval_loss, eval_score)
    GET  /v1/jobs/{job}/transitions   its state history (time, state, reason)
    GET  /v1/jobs/{job}/adapter   its adapter as `aspen export` writes it (a PEFT folder), tar.gz (?checkpoint=true)
    GET  /v1/jobs/{job}/spec      its spec as a jobs file (YAML) that submits it again
    POST /v1/jobs/{job}/generate  "try it": a prompt continued by a running job's adapter and by the base alone
    POST /v1/sweeps               a sweep file (JSON or YAML): 201 with the sweep's status; the service runs it
    GET  /v1/sweeps[/{name}]      every sweep, or one: its state, trials (leaderboard) and best trial
    POST /v1/sweeps/{name}/cancel no more trials; the running ones cancelled
    GET  /v1/events               server-sent events: every job state change (and, with ?progress=true, steps)
    GET  /v1/whoami               who the token is (name, admin)
    GET  /v1/service              the service's description (trainers, policy, URLs)
    GET  /v1/health               no token needed: is the API up, does the service answer
    GET  /openapi.json            the OpenAPI schema (and /docs)
    GET  /                        the web console (orchestrator/http_console.py, docs/console.md)

Every /v1 endpoint but health needs `Authorization: Bearer <token>` (`orchestrator.http_token`; compared
in constant time). Refusals are JSON `{"detail": ..., "errors": [...]}` and change nothing in the service:
401 no or a wrong token, 404 an unknown job, 409 a name an unfinished job holds or a job in the wrong state
(cancelling a finished one), 413 a body over `max_body_bytes` or with more values than a job spec has, 415 a
body neither JSON nor YAML, 422 a malformed body (with its line and column), one nested too deeply or with
YAML anchors or aliases, or an invalid spec (each problem with its field). Bodies are parsed in worker
threads within limits (`orchestrator/spec_text.py`), never on the event loop: a hostile body is refused in
well under a second, and the other endpoints answer meanwhile. A service that does not answer (stopped,
restarting, its job table locked) is a 503 with the reason; the server stays up and connects again.

The event stream follows the job table's transitions by number (`Client.transitions_after`), polled every
`events_poll_s`: the table is the service's record of every state change, so the stream has no gaps (a
client that reconnects with `Last-Event-ID` gets every transition since), works whether or not the MQTT
broker runs, and needs nothing but this server's Ray connection. The MQTT events, by contrast, are
at-most-once for a subscriber that is not connected (only the last state per job is retained)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from actors.engine.adapter_export import ExportError
from actors.engine.spec import JobSpec, RunSpec
from actors.service.audit import AuditLog
from actors.service.job_table import JOB_STATES, TERMINAL_STATES, JobRecord
from actors.service.users import UserBook, UsersFileError
from orchestrator.export import FoundJob, adapter_archive
from orchestrator.http_console import Generated, GenerateRequest, mount_console, serving_answer, spec_answer
from orchestrator.http_submissions import Refused, parse_body, submissions_from
from orchestrator.http_users import Caller, Gate, ServiceStateFolder, find_job, find_sweep, visible
from orchestrator.jobs_file import SpecError
from orchestrator.service_calls import ServiceLink, call_service

log = logging.getLogger(__name__)

API_VERSION = "1"
DEFAULT_PORT = 8765
MAX_BODY_BYTES = 1 << 20     # a job spec is a few hundred bytes; its data is a path or URI, never inline
EVENTS_POLL_S = 1.0
PARSE_THREADS = 2            # bodies parsed at once (each within http_submissions.BODY_LIMITS); more wait their turn
EVENTS_BATCH = 500           # transitions per poll at most (a backlog is sent in batches without waiting)
UNFINISHED_STATES = tuple(state for state in JOB_STATES if state not in TERMINAL_STATES)
STATE_FILTER = f"only jobs in these states: {', '.join(JOB_STATES)}"


# -- response models (the OpenAPI schema's) -----------------------------------------------------------------
class ErrorBody(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


class Submitted(BaseModel):
    jobs: list[JobRecord]


class LossRow(BaseModel):
    step: int
    loss: float | None = None
    tokens: int | None = None
    lr: float | None = None
    grad_norm: float | None = None
    eval_loss: float | None = None
    eval_score: float | None = None   # the job's eval_generate metric, where it has one
    time: float


class Transition(BaseModel):
    time: float
    state: str
    reason: str


@dataclass(frozen=True)
class EventStart:
    """Where an event stream starts: its job (None: every job), the transition number it follows, and the
    jobs of its snapshot (None when it resumes after a Last-Event-ID)."""

    job: str | None
    after: int
    records: list[JobRecord] | None


class Health(BaseModel):
    status: str
    service: str
    detail: str | None = None


REFUSALS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (401, "no token, or a wrong one"), (404, "no such job"), (409, "the job's state or name conflicts"),
    (503, "the service does not answer; the reason"))}


class BodyLimit:
    """413, as JSON with the limit, for a request body over `max_bytes`: at once where its Content-Length
    says so, else when the endpoint reads past the limit (a chunked body), before anything is done with it."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> HTTPException:
        return HTTPException(413, f"the body has {size} bytes; this API takes at most {self.max_bytes} (a job spec "
                                  "names its data by path or URI)")

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            error = self.too_large(length)
            await JSONResponse({"detail": error.detail}, status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self.too_large(f"more than {self.max_bytes}")   # answered by the app's HTTPException handler
            return message

        await self.app(scope, limited, send)


def _request_body_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """The request body's schema (one job's fields or a jobs file) and the component schemas it refers to."""
    (_, defs) = models_json_schema([(JobSpec, "validation"), (RunSpec, "validation")],
                                   ref_template="#/components/schemas/{model}")
    body = {"anyOf": [{"$ref": "#/components/schemas/JobSpec"}, {"$ref": "#/components/schemas/RunSpec"}]}
    return body, defs.get("$defs", {})


def create_app(link: ServiceLink, token: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               events_poll_s: float = EVENTS_POLL_S, users: UserBook | None = None,
               audit: AuditLog | None = None, console: bool = True) -> FastAPI:
    """The API over the service reached through `link`, for requests that carry `token` (while there is no
    users file: an admin's) or a token of `users` (orchestrator/http_users.py); actions are written to
    `audit` where given. `console`: the web console at `/`."""
    if len(token) < 16:
        raise ValueError("the API token is shorter than 16 characters; generate one with `aspen http-token --rotate`")
    app = FastAPI(title="aspen", version=API_VERSION,
                  description="Fine-tune many LoRA adapters at once on one shared base model: submit, follow and "
                              "cancel jobs of a running aspen service. Every /v1 endpoint but /v1/health needs "
                              "`Authorization: Bearer <token>` (`aspen http-token` prints it).")
    bearer = HTTPBearer(auto_error=False, description="your token (`aspen user add`), or, on a service without "
                                                      "users, the one `aspen http-token` prints")
    gate = Gate(token, users)
    submit_lock = threading.Lock()   # a name check and its submission are one step for this server
    parsers = anyio.CapacityLimiter(PARSE_THREADS)

    def require_token(request: Request,
                      credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:
        if credentials is None:   # a 401 whether or not the service answers: which hint, only if it does
            try:
                hint = ("`aspen user add NAME` on the service's machine issues one" if gate.has_users else
                        "`aspen http-token` on the service's machine prints the token")
            except HTTPException:
                hint = ("`aspen user add NAME` (a users file) or `aspen http-token` (the single token) on the "
                        "service's machine gives one")
            raise HTTPException(401, "this endpoint needs `Authorization: Bearer <token>`; " + hint,
                                headers={"WWW-Authenticate": "Bearer"})
        try:
            caller = gate.caller(credentials.credentials)
        except UsersFileError as error:
            raise HTTPException(503, f"the users file cannot be read: {error}") from None
        if caller is None:
            log.warning("aspen http: a wrong token from %s", request.client.host if request.client else "?")
            raise HTTPException(401, "wrong token (" + (
                f"a users file is in force ({gate.users.path}): only its users' tokens open the API, the service's "
                "single token (`aspen http-token`) no longer unless an admin holds it (`aspen user list`); a token "
                "removed, rotated or never issued: `aspen user token NAME --rotate` issues a new one"
                if gate.has_users else
                "no users file: the service's single token is in force; `aspen http-token` on the service's machine "
                "prints it") + ")",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        request.state.caller = caller
        return caller

    def audited(caller: Caller, action: str, target: str, **details: Any) -> None:
        if audit is not None:
            audit.record(caller.name, action, target, **details)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(item.get("loc", ())), "msg": item.get("msg", ""), "type": item.get("type", "")}
                  for item in error.errors()]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return JSONResponse({"detail": f"invalid request: {detail}", "errors": errors}, status_code=422)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> JSONResponse:
        return JSONResponse({"detail": error.detail, "errors": error.errors}, status_code=error.status)

    @app.get("/v1/health", response_model=Health, tags=["service"],
             responses={503: {"model": Health, "description": "the service does not answer"}})
    def health() -> Any:
        """Is the API up, and does the service answer? No token needed; says nothing else about the service."""
        try:
            call_service(link, lambda client: client.info())
        except HTTPException as error:
            return JSONResponse(Health(status="degraded", service="unavailable", detail=error.detail).model_dump(),
                                status_code=503)
        return Health(status="ok", service="up")

    api = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=REFUSALS)

    @api.get("/service", tags=["service"])
    def service_info() -> dict[str, Any]:
        """The service's description: state folder, policy, output root, trainers, metrics and events URLs."""
        return call_service(link, lambda client: client.info())

    @api.get("/whoami", tags=["service"])
    def whoami(caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Who the token is: `{"name", "admin"}` (the console shows an admin everyone's jobs and a user filter)."""
        return {"name": caller.name, "admin": caller.admin}

    body_schema, components = _request_body_schema()

    @api.post("/jobs", status_code=201, response_model=Submitted, tags=["jobs"],
              responses={413: {"model": ErrorBody, "description": "the body is too large"},
                         415: {"model": ErrorBody, "description": "the body is neither JSON nor YAML"},
                         422: {"model": ErrorBody, "description": "malformed body or invalid spec; `errors` names "
                                                                  "each field"}},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": body_schema},
                  "application/yaml": {"schema": {"type": "string", "description": "a jobs file, or one job's "
                                                                                   "fields, as YAML text"}}}}})
    async def submit(request: Request, caller: Caller = Depends(require_token)) -> Any:
        """Submit one job (its fields, with base_model, quantization, dtype and output_dir beside them) or
        every job of a jobs file (`jobs: [...]`), all or none. Paths are the service's machine's: data as an
        absolute path or a storage URI. A name that an unfinished job holds is refused (409), so that the
        name keeps naming one job."""
        # off the event loop (the API answers meanwhile), at most PARSE_THREADS at once, within BODY_LIMITS
        data, text = await anyio.to_thread.run_sync(parse_body, await request.body(),
                                                    request.headers.get("content-type"), limiter=parsers)

        def enter(client: Any) -> list[JobRecord]:
            submissions = [submission.model_copy(update={"user": caller.owner}) for submission in
                           submissions_from(data, text=text, output_root=client.info().get("output_root"),
                                            check_files=caller.admin)]
            with submit_lock:
                names = {s.job.name for s in submissions}
                held = [r for r in client.jobs(UNFINISHED_STATES) if r.name in names]
                if held:   # another user's job is not described: only that its name is taken
                    raise HTTPException(409, "; ".join(f"job '{r.name}' is already {r.state} as {r.id}"
                                                       if caller.sees(r.user) else
                                                       f"job name '{r.name}' is held by another user's unfinished job"
                                                       for r in held)
                                        + "; cancel it, wait for it to end, or choose another name")
                records = client.submit_records(submissions)
            for record in records:
                audited(caller, "job.submit", record.id, name=record.name)
            return records

        records = await run_in_threadpool(call_service, link, enter)
        headers = {"Location": f"/v1/jobs/{records[0].id}"} if len(records) == 1 else None
        return JSONResponse(Submitted(jobs=records).model_dump(mode="json"), status_code=201, headers=headers)

    @api.get("/jobs", response_model=list[JobRecord], tags=["jobs"])
    def jobs(state: list[str] | None = Query(None, description=STATE_FILTER),
             caller: Caller = Depends(require_token)) -> Any:
        """Every job of yours (an admin: everyone's), oldest first, or those in the given states
        (`?state=queued&state=running`)."""
        unknown = sorted(set(state or ()) - set(JOB_STATES))
        if unknown:
            raise HTTPException(422, f"unknown job states {unknown}; the states are {', '.join(JOB_STATES)}")
        return visible(call_service(link, lambda client: client.jobs(state or None)), caller)

    @api.get("/jobs/{job}", response_model=JobRecord, tags=["jobs"])
    def status(job: str, caller: Caller = Depends(require_token)) -> Any:
        """One job of yours, by id or by a name that only one of your jobs has."""
        return call_service(link, lambda client: find_job(client, caller, job))

    @api.get("/jobs/{job}/losses", response_model=list[LossRow], tags=["jobs"])
    def losses(job: str, caller: Caller = Depends(require_token)) -> Any:
        """One row per optimizer step: step, loss, tokens, lr, grad_norm, eval_loss and eval_score (where
        evaluated), time."""
        return call_service(link, lambda client: client.losses(find_job(client, caller, job).id))

    @api.get("/jobs/{job}/transitions", response_model=list[Transition], tags=["jobs"])
    def transitions(job: str, caller: Caller = Depends(require_token)) -> Any:
        """The job's state history, oldest first."""
        rows = call_service(link, lambda client: client.transitions(find_job(client, caller, job).id))
        return [Transition(time=when, state=state, reason=reason) for when, state, reason in rows]

    @api.get("/jobs/{job}/spec", tags=["jobs"])
    def job_spec(job: str, caller: Caller = Depends(require_token)) -> Any:
        """The job's spec as a jobs file that submits it again (`yaml`: its text, `jobs_file`: its data); its
        output folder is left out (a clone gets its own)."""
        return call_service(link, lambda client: spec_answer(client.submission(find_job(client, caller, job).id)))

    @api.get("/jobs/{job}/serving", tags=["jobs"],
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

    @api.post("/jobs/{job}/generate", response_model=Generated, tags=["jobs"])
    def generate(job: str, body: GenerateRequest, caller: Caller = Depends(require_token)) -> Any:
        """"Try it": the prompt continued greedily by the job's current adapter and by the base model alone, on
        its trainer between two steps (the steps wait meanwhile). 409 for a job not running on a trainer (queued,
        paused or ended: export a finished job's adapter and serve it with vLLM or PEFT instead)."""
        def run(client: Any) -> dict[str, Any]:
            record = find_job(client, caller, job)
            answer = client.generate(record.id, body.prompt, body.max_new_tokens)
            audited(caller, "job.generate", record.id, name=record.name)
            return answer

        return call_service(link, run)

    def job_verb(verb: str, what: str) -> None:
        def act(job: str, caller: Caller = Depends(require_token)) -> Any:
            def run(client: Any) -> JobRecord:
                record = find_job(client, caller, job)
                after = getattr(client, verb)(record.id)
                audited(caller, f"job.{verb}", record.id, name=record.name)
                return after

            return call_service(link, run)

        act.__name__ = verb
        act.__doc__ = what
        api.post(f"/jobs/{{job}}/{verb}", response_model=JobRecord, tags=["jobs"])(act)

    job_verb("cancel", "Cancel a queued, running or paused job (a running one is checkpointed at its next step); "
                       "409 for a job that has ended.")
    job_verb("pause", "Pause a queued or running job (checkpointed; /resume continues it).")
    job_verb("resume", "Queue a paused, failed or cancelled job again; it continues from its last checkpoint.")

    @api.get("/jobs/{job}/adapter", response_class=Response, tags=["jobs"],
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

    @api.post("/sweeps", status_code=201, tags=["sweeps"],
              responses={422: {"model": ErrorBody, "description": "an invalid sweep; `detail` names each field"},
                         409: {"model": ErrorBody, "description": "a sweep of that name with other settings"}})
    async def submit_sweep(request: Request, caller: Caller = Depends(require_token)) -> Any:
        """Start a sweep (a sweep file as JSON or YAML: docs/sweeps.md; data and output_dir absolute paths on
        the service's machine). The service runs it from now on; 201 with its status. The same sweep sent
        again answers with it (nothing new starts)."""
        data, _ = await anyio.to_thread.run_sync(parse_body, await request.body(),
                                                 request.headers.get("content-type"), limiter=parsers)

        def start(client: Any) -> dict[str, Any]:
            from orchestrator.sweep import sweep_spec_from

            try:
                spec = sweep_spec_from(data, source="request", base_dir=None)
            except SpecError as error:
                raise Refused(422, f"nothing was started:\n{error}") from None
            if spec.user not in (None, caller.name) and not caller.admin:
                raise Refused(422, f"user: you submit as {caller.name}; leave user out (nothing was started)")
            spec = spec.model_copy(update={"user": spec.user or caller.owner})
            held = [s for s in client.sweeps() if s["name"] == spec.name and not caller.sees(s.get("user"))]
            if held:
                raise Refused(409, f"sweep name '{spec.name}' is held by another user's sweep; choose another name")
            status = client.sweep(spec)
            audited(caller, "sweep.submit", spec.name)
            return status

        status = await run_in_threadpool(call_service, link, start)
        return JSONResponse(status, status_code=201, headers={"Location": f"/v1/sweeps/{status['name']}"})

    @api.get("/sweeps", tags=["sweeps"])
    def sweeps(caller: Caller = Depends(require_token)) -> Any:
        """Every sweep of yours (an admin: everyone's) with its leaderboard."""
        return [s for s in call_service(link, lambda client: client.sweeps()) if caller.sees(s.get("user"))]

    @api.get("/sweeps/{name}", tags=["sweeps"])
    def sweep_status(name: str, caller: Caller = Depends(require_token)) -> Any:
        """One sweep of yours: state (running, done, cancelled, failed), its trials (settings, state, objective,
        steps, why stopped), the best trial."""
        return call_service(link, lambda client: find_sweep(client, caller, name))

    @api.post("/sweeps/{name}/cancel", tags=["sweeps"])
    def cancel_sweep(name: str, caller: Caller = Depends(require_token)) -> Any:
        """Start no more trials of the sweep and cancel its running ones."""
        def run(client: Any) -> dict[str, Any]:
            find_sweep(client, caller, name)
            status = client.cancel_sweep(name)
            audited(caller, "sweep.cancel", name)
            return status

        return call_service(link, run)

    @api.get("/accounts", tags=["service"])
    def accounts(caller: Caller = Depends(require_token)) -> Any:
        """What each user's jobs used, summed over the fused steps they took part in: jobs, trained tokens,
        step-seconds (their share of each step's time by their tokens) and GPU-seconds. Yours only (an admin:
        every user's; user null: jobs submitted through Ray)."""
        rows = call_service(link, lambda client: client.accounts())
        return [row for row in rows if caller.admin or row["user"] == caller.name]

    @api.get("/audit", tags=["service"], responses={403: {"model": ErrorBody, "description": "not an admin"}})
    def audit_rows(user: str | None = Query(None, description="only this user's actions"),
                   after: float | None = Query(None, description="only actions after this time (seconds since "
                                                                 "the epoch)"),
                   caller: Caller = Depends(require_token)) -> Any:
        """The audit log (admins only): one row per action (time, user, action, target, details), oldest first."""
        if not caller.admin:
            raise HTTPException(403, "the audit log is for admins (`aspen user add NAME --admin`)")
        if audit is None:
            return []
        return audit.rows(user=user, after=after)

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

    @api.get("/events", response_class=EventSourceResponse, tags=["events"])
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
                        "loss": record.loss, "eval_loss": record.eval_loss, "tokens": record.tokens,
                        "tokens_per_s": record.tokens_per_s, "time": record.updated_at})
            if len(rows) < EVENTS_BATCH:
                await asyncio.sleep(events_poll_s)

    app.include_router(api)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if console:
        mount_console(app)   # last: /v1, /docs and /openapi.json are matched first
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(*, address: str = "auto", host: str = "127.0.0.1", port: int = DEFAULT_PORT, token_file: str | None = None,
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None, state_dir: str | None = None) -> None:
    """Run the API with uvicorn until interrupted (`aspen http`), over the service that `Client.connect(address)`
    finds, from a child process that holds the Ray connection (`orchestrator.http_bridge`: this process never
    joins Ray, so it outlives the cluster; a service not running yet is a 503 until it is). Bound to loopback
    unless `host` says otherwise (then a warning: the token is the only guard, and without TLS it crosses the
    network in clear text). Requests are made as the users of `<state_dir>/users.json` once it exists
    (`aspen user add`), and their actions written to `<state_dir>/audit.jsonl`: `state_dir` given, or the
    service's own state folder, which the service is asked for (`ServiceStateFolder`)."""
    import uvicorn

    from orchestrator.http_bridge import ProcessLink
    from orchestrator.http_token import ensure_token
    from orchestrator.http_token import token_file as token_path

    token = ensure_token(token_file)
    if not is_loopback(host):
        print(f"aspen http: WARNING: serving on {host}, not loopback: anyone who reaches port {port} and holds the "
              "token can submit and cancel jobs" + ("" if ssl_certfile else ", and without TLS (--ssl-certfile) the "
                                                    "token crosses the network in clear text") + "; while there is no "
              "users file (`aspen user add`), the single token acts as an operator and may train on any file this "
              "service's account can read", file=sys.stderr)
    link = ProcessLink(address)
    scheme = "https" if ssl_certfile else "http"
    print(f"aspen HTTP API on {scheme}://{host}:{port} (OpenAPI: /openapi.json, /docs; the web console: /); its "
          "token is in "
          f"{token_path(token_file)} (`aspen http-token` prints it)", file=sys.stderr, flush=True)
    try:
        if state_dir:   # given: these files, whatever the service says
            users, audit = UserBook.in_state_dir(state_dir), AuditLog.in_state_dir(state_dir)
        else:           # the service's own state folder, asked of it on first need
            folder = ServiceStateFolder(lambda: call_service(link, lambda client: client.info()))
            users, audit = folder.users(), folder.audit()
        # event streams never end by themselves: a stop waits this long for them, then closes them
        uvicorn.run(create_app(link, token, users=users, audit=audit), host=host, port=port, log_level="info",
                    ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, timeout_graceful_shutdown=5)
    finally:
        link.close()
