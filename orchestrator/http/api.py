"""The HTTP API next to the Ray client (FastAPI, run by uvicorn; `aspen http`): submit, list, follow and
cancel jobs without being a Ray driver. The app answers over the Ray client's calls through a `link`:
`aspen http` keeps the Ray connection in a child process (`orchestrator.http.bridge.ProcessLink`, so that
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
    POST /v1/jobs/{job}/generate  "try it": a prompt continued by a job's adapter (running or ended) and by the base
    GET  /v1/jobs/{job}/generations  an eval_generate evaluation's rows (?step=N; default the last): prompt,
                                  reference, the adapter's prediction, score; and every evaluated step
    POST /v1/sweeps               a sweep file (JSON or YAML): 201 with the sweep's status; the service runs it
    GET  /v1/sweeps[/{name}]      every sweep, or one: its state, trials (leaderboard) and best trial
    POST /v1/sweeps/{name}/cancel no more trials; the running ones cancelled
    GET  /v1/events               server-sent events: every job state change (and, with ?progress=true, steps)
    GET  /v1/whoami               who the token is (name, admin)
    GET  /v1/service              the service's description (trainers, policy, URLs)
    GET  /v1/health               no token needed: is the API up, does the service answer
    GET  /openapi.json            the OpenAPI schema (and /docs)
    GET  /                        the web console (orchestrator/http/console.py, docs/console.md)

Every /v1 endpoint but health needs `Authorization: Bearer <token>` (`orchestrator.http.token`; compared
in constant time). Refusals are JSON `{"detail": ..., "errors": [...]}` and change nothing in the service:
401 no or a wrong token, 404 an unknown job, 409 a name an unfinished job holds, a name several jobs have (give
the id) or a job in the wrong state
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

import ipaddress
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic.json_schema import models_json_schema

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook, UsersFileError
from actors.service.scheduler.interactive_jobs import TINKER_FOLDER
from actors.spec.job_spec import JobSpec
from actors.spec.run_spec import RunSpec
from orchestrator.http.callers import Caller, Gate, ServiceStateFolder
from orchestrator.http.console import mount_console
from orchestrator.http.event_stream import add_event_routes
from orchestrator.http.jobs import (
    add_job_budget_routes,
    add_job_detail_routes,
    add_job_reading_routes,
    add_job_routes,
    add_job_verb_routes,
)
from orchestrator.http.request_bodies import Refused
from orchestrator.http.responses import REFUSALS, StrictJSONResponse
from orchestrator.http.routes import Routes, operation_route
from orchestrator.http.service_routes import add_service_routes
from orchestrator.http.sweeps import add_sweep_routes
from orchestrator.operation_models import Health
from orchestrator.service_calls import ServiceLink, call_service

log = logging.getLogger(__name__)

API_VERSION = "1"
DEFAULT_PORT = 8765
MAX_BODY_BYTES = 1 << 20     # a job spec is a few hundred bytes; its data is a path or URI, never inline
EVENTS_POLL_S = 1.0


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


def _request_error(item: dict[str, Any], body: str) -> dict[str, Any]:
    """One of FastAPI's request errors for the answer; a malformed JSON body's (located by FastAPI at a character
    offset, `body.10`) with its line and column, as a job submission's says them."""
    loc = list(item.get("loc", ()))
    if item.get("type") != "json_invalid" or len(loc) != 2 or not isinstance(loc[1], int):
        return {"loc": loc, "msg": item.get("msg", ""), "type": item.get("type", "")}
    offset = min(loc[1], len(body))
    line = body.count("\n", 0, offset) + 1
    column = offset - (body.rfind("\n", 0, offset) + 1) + 1
    problem = (item.get("ctx") or {}).get("error") or item.get("msg", "")
    return {"loc": ["body"], "msg": f"malformed JSON: {problem} at line {line}, column {column}",
            "type": "json_invalid", "line": line, "column": column}


def create_app(link: ServiceLink, token: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               events_poll_s: float = EVENTS_POLL_S, users: UserBook | None = None,
               audit: AuditLog | None = None, console: bool = True,
               tinker_dir: Callable[[], Path] | None = None) -> FastAPI:
    """The API over the service reached through `link`, for requests that carry `token` (while there is no
    users file: an admin's) or a token of `users` (orchestrator/http/callers.py); actions are written to
    `audit` where given. `console`: the web console at `/`. `tinker_dir`: where the Tinker API (`/api/v1`,
    docs/tinker.md) writes its models' saves (the service's `<state folder>/tinker`); None: not served."""
    if len(token) < 16:
        raise ValueError("the API token is shorter than 16 characters; generate one with `aspen http-token --rotate`")
    app = FastAPI(title="aspen", version=API_VERSION, default_response_class=StrictJSONResponse,
                  description="Fine-tune many LoRA adapters at once on one shared base model: submit, follow and "
                              "cancel jobs of a running aspen service. Every /v1 endpoint but /v1/health needs "
                              "`Authorization: Bearer <token>` (`aspen http-token` prints it).")
    bearer = HTTPBearer(auto_error=False, description="your token (`aspen user add`), or, on a service without "
                                                      "users, the one `aspen http-token` prints")
    gate = Gate(token, users)

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

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        body = (await request.body()).decode("utf-8", errors="replace")
        errors = [_request_error(item, body) for item in error.errors()]
        detail = "; ".join(e["msg"] if e["type"] == "json_invalid" else f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                           for e in errors)
        return JSONResponse({"detail": f"invalid request: {detail}", "errors": errors}, status_code=422)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> JSONResponse:
        return JSONResponse({"detail": error.detail, "errors": error.errors}, status_code=error.status)

    @operation_route(app, "health", tags=["service"],
             responses={503: {"model": Health, "description": "the service does not answer"}})
    def health() -> Any:
        """Is the API up, and does the service answer? No token needed; says nothing else about the service."""
        try:
            call_service(link, lambda client: client.info())
        except HTTPException as error:
            return JSONResponse(Health(status="degraded", service="unavailable", detail=error.detail).model_dump(),
                                status_code=503)
        return Health(status="ok", service="up")

    body_schema, components = _request_body_schema()
    routes = Routes(link, require_token, audit, events_poll_s, body_schema)
    api = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=REFUSALS)
    for add in (add_service_routes, add_job_routes, add_job_reading_routes, add_job_detail_routes,
                add_job_verb_routes, add_job_budget_routes, add_sweep_routes,
                add_event_routes):
        add(api, routes)
    app.include_router(api)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if tinker_dir is not None:
        mount_tinker(app, link, gate, tinker_dir)
    if console:
        mount_console(app)   # last: /v1, /docs and /openapi.json are matched first
    return app


def mount_tinker(app: FastAPI, link: ServiceLink, gate: Gate, weights_dir: Callable[[], Path]) -> None:
    """The Tinker API under /api/v1 (orchestrator/tinker/): its key is `tml-` and the caller's aspen token. Not
    served (said in the log) where the `tinker` SDK, whose types it speaks, is not installed."""
    try:
        from orchestrator.tinker.remote_calls import RemoteCalls, service_caller
        from orchestrator.tinker.tinker_routes import TinkerBackend, tinker_router
    except ImportError as error:
        log.warning("aspen http: the Tinker API is not served (%s); `pip install 'aspen[tinker]'` serves it", error)
        return

    def authenticate(token: str) -> str | None:
        try:
            caller = gate.caller(token)
        except UsersFileError as error:
            raise HTTPException(503, f"the users file cannot be read: {error}") from None
        return None if caller is None else caller.name

    backend = TinkerBackend(RemoteCalls(service_caller(link)), None, weights_dir, authenticate).start()
    app.include_router(tinker_router(backend))
    app.router.on_shutdown.append(backend.close)
    app.state.tinker = backend


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
    finds, from a child process that holds the Ray connection (`orchestrator.http.bridge`: this process never
    joins Ray, so it outlives the cluster; a service not running yet is a 503 until it is). Bound to loopback
    unless `host` says otherwise (then a warning: the token is the only guard, and without TLS it crosses the
    network in clear text). Requests are made as the users of `<state_dir>/users.json` once it exists
    (`aspen user add`), and their actions written to `<state_dir>/audit.jsonl`: `state_dir` given, or the
    service's own state folder, which the service is asked for (`ServiceStateFolder`)."""
    import uvicorn

    from orchestrator.http.bridge import ProcessLink
    from orchestrator.http.token import ensure_token
    from orchestrator.http.token import token_file as token_path

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
        tinker_dir = (lambda: Path(state_dir).expanduser() / TINKER_FOLDER) if state_dir else \
            (lambda: folder.path() / TINKER_FOLDER)
        # event streams never end by themselves: a stop waits this long for them, then closes them
        uvicorn.run(create_app(link, token, users=users, audit=audit, tinker_dir=tinker_dir), host=host, port=port,
                    log_level="info",
                    ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, timeout_graceful_shutdown=5)
    finally:
        link.close()
