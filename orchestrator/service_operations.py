"""The service's operations, each defined once: what it does, its typed request and response
(orchestrator/operation_models.py), the scheduler actor's method that does it, and where users reach it (the
Ray `Client`, the HTTP API's route, the `HttpClient`, the `aspen` command). The HTTP routes are built from it
(`orchestrator/http/routes.py:operation_route`: path, method and response model); the other surfaces are
checked against it (tests/unit/orchestrator/test_service_operations.py): a surface that lacks an operation
the catalogue gives it fails, as does a route, client method or command the catalogue does not know, a
client method whose arguments are not the request's, or a route whose parameters or answer are not the
operation's. Adding an operation is one entry here plus its implementation on each surface it names.

A surface an operation is not on says why (`not_on`): e.g. the event stream is HTTP's (the Ray client reads
the job table's transitions by number instead), deleting a job is an operator's (Ray only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.service.table.job_record import JobRecord
from actors.spec.job_spec import JobSpec
from actors.spec.run_spec import RunSpec
from actors.spec.sweep_spec import SweepSpec
from orchestrator.operation_models import (
    AccountRow,
    AuditQuery,
    AuditRow,
    EventsQuery,
    ExportCall,
    ExtendCall,
    GenerateCall,
    Generated,
    Generations,
    GenerationsQuery,
    Health,
    JobRef,
    JobSpecText,
    JobsQuery,
    LossRow,
    RaiseBudget,
    RaiseMaxSteps,
    ServiceInfo,
    ServingAnswer,
    SubmitRecords,
    Submitted,
    SweepRef,
    SweepStatus,
    Transition,
    TransitionsAfter,
    TryTicket,
    WaitAll,
    WaitReady,
    Whoami,
)


@dataclass(frozen=True)
class Operation:
    name: str                           # the Ray client's and the HttpClient's method
    does: str
    scheduler: str | None               # the scheduler actor's method (None: answered without it)
    http: tuple[str, str] | None        # (method, path) of its HTTP route
    cli: str | None = None              # the `aspen` command that runs it
    ray: bool = True                    # on the Ray `Client`
    http_client: bool = True            # on the `HttpClient`
    not_on: dict[str, str] = field(default_factory=dict)   # surface -> why the operation is not there
    request: Any = None                 # its arguments (a model of them), or the spec that is its one argument
    response: Any = None                # what the HTTP route answers (None: not JSON, or no route)
    spec_argument: bool = False         # `request` is the spec the clients' method takes as its one argument


OPERATIONS: tuple[Operation, ...] = (
    Operation("info", "the service's description: state folder, policy, trainers, URLs", "info",
              ("GET", "/v1/service"),
              response=ServiceInfo),
    Operation("submit", "submit one job (a spec, a dict of its fields, or a one-job jobs file)", "submit",
              ("POST", "/v1/jobs"), "submit",
              request=JobSpec, response=Submitted, spec_argument=True),
    Operation("submit_run", "submit every job of a jobs file, all or none", "submit_many", ("POST", "/v1/jobs"),
              "submit",
              request=RunSpec, response=Submitted, spec_argument=True),
    Operation("submit_many", "submit several jobs together, all or none", "submit_many", ("POST", "/v1/jobs"),
              request=JobSpec, response=Submitted, spec_argument=True),
    Operation("jobs", "every job (or those in the given states)", "jobs", ("GET", "/v1/jobs"), "status",
              request=JobsQuery, response=list[JobRecord]),
    Operation("status", "one job, by id or by a name only one job has", "status", ("GET", "/v1/jobs/{job}"),
              "status",
              request=JobRef, response=JobRecord),
    Operation("losses", "a job's rows, one per optimizer step", "progress", ("GET", "/v1/jobs/{job}/losses"),
              "losses",
              request=JobRef, response=list[LossRow]),
    Operation("transitions", "a job's state history", "transitions", ("GET", "/v1/jobs/{job}/transitions"),
              request=JobRef, response=list[Transition]),
    Operation("cancel", "cancel a job (checkpointed first)", "cancel", ("POST", "/v1/jobs/{job}/cancel"), "cancel",
              request=JobRef, response=JobRecord),
    Operation("pause", "pause a job (checkpointed)", "pause", ("POST", "/v1/jobs/{job}/pause"), "pause",
              request=JobRef, response=JobRecord),
    Operation("resume", "queue a paused, failed or cancelled job again", "resume", ("POST", "/v1/jobs/{job}/resume"),
              "resume",
              request=JobRef, response=JobRecord),
    Operation("generate", "\"try it\": a prompt continued by a job's adapter (running or ended) and by the base",
              "generate",
              ("POST", "/v1/jobs/{job}/generate"),
              request=GenerateCall, response=Generated),
    Operation("withdraw_try", "withdraw a \"try it\" its caller stopped waiting for (not run, or cut short)",
              "withdraw_try", None, http_client=False,
              not_on={"http": "the HTTP API withdraws its own \"try it\" when its client disconnects"},
              request=TryTicket),
    Operation("generations", "an eval_generate evaluation's rows: prompt, reference, the adapter's prediction, score",
              None, ("GET", "/v1/jobs/{job}/generations"), "generations",
              request=GenerationsQuery, response=Generations),
    Operation("export", "a job's adapter as a PEFT folder", None, ("GET", "/v1/jobs/{job}/adapter"), "export",
              request=ExportCall),
    Operation("spec", "a job's spec as a jobs file that submits it again", "submission", ("GET", "/v1/jobs/{job}/spec"),
              ray=False, not_on={"ray": "Client.submission gives the JobSubmission itself"},
              request=JobRef, response=JobSpecText),
    Operation("serving", "the vLLM and PEFT lines for a job's adapter on the service's machine", None,
              ("GET", "/v1/jobs/{job}/serving"), ray=False,
              not_on={"ray": "a Ray client runs on a machine of the cluster: aspen export prints the lines there"},
              request=JobRef, response=ServingAnswer),
    Operation("wait", "block until a job has ended", None, None,
              not_on={"http": "the clients poll status (or follow /v1/events)"},
              request=JobRef),
    Operation("sweep", "start a sweep (or find the same one running)", "sweep", ("POST", "/v1/sweeps"), "sweep",
              request=SweepSpec, response=SweepStatus, spec_argument=True),
    Operation("check_sweep", "what sweep would refuse, nothing started (the HTTP API's own call, before it reads "
              "the sweep's rows)", "check_sweep", None, http_client=False,
              not_on={"http": "POST /v1/sweeps asks it before reading the rows"},
              request=SweepSpec, spec_argument=True),
    Operation("sweeps", "every sweep with its leaderboard", "sweeps_list", ("GET", "/v1/sweeps"),
              response=list[SweepStatus]),
    Operation("sweep_status", "one sweep: state, trials, best", "sweep", ("GET", "/v1/sweeps/{name}"), "sweep",
              request=SweepRef, response=SweepStatus),
    Operation("cancel_sweep", "start no more trials and cancel the running ones", "cancel_sweep",
              ("POST", "/v1/sweeps/{name}/cancel"),
              request=SweepRef, response=SweepStatus),
    Operation("accounts", "what each user's jobs used", "accounts", ("GET", "/v1/accounts"),
              response=list[AccountRow]),
    Operation("events", "server-sent events: every job state change, steps", "transitions_after",
              ("GET", "/v1/events"), ray=False,
              not_on={"ray": "Client.transitions_after reads the same transitions by number"},
              request=EventsQuery),
    Operation("health", "is the API up, does the service answer (no token)", "info", ("GET", "/v1/health"),
              ray=False, not_on={"ray": "a Ray client's call either answers or raises"},
              response=Health),
    Operation("whoami", "who the token is", None, ("GET", "/v1/whoami"), ray=False, http_client=False,
              not_on={"ray": "Ray has no users", "http_client": "the console's; HttpClient users know their token"},
              response=Whoami),
    Operation("audit", "the audit log (admins)", None, ("GET", "/v1/audit"), ray=False, http_client=False,
              not_on={"ray": "an operator reads audit.jsonl", "http_client": "not yet: curl or the console"},
              request=AuditQuery, response=list[AuditRow]),
    Operation("delete", "remove an ended job and its history from the table", "delete", None, http_client=False,
              not_on={"http": "an operator's (aspen run --overwrite uses it)"},
              request=JobRef),
    Operation("submission", "a job's stored submission", "submission", None, http_client=False,
              not_on={"http": "GET /v1/jobs/{job}/spec answers it as a jobs file"},
              request=JobRef),
    Operation("transitions_after", "the job table's transitions after a number", "transitions_after", None,
              http_client=False, not_on={"http": "GET /v1/events streams them"},
              request=TransitionsAfter),
    Operation("trainers", "each trainer's status", "trainers", None, http_client=False,
              not_on={"http": "GET /v1/service has them"}),
    Operation("wait_ready", "block until every trainer has set up (or failed to, or no node can hold it)", "wait_ready",
              None, http_client=False,
              not_on={"http": "a service behind the API is already up"},
              request=WaitReady),
    Operation("submit_records", "submit checked submissions (the HTTP API's own call)", "submit_many", None,
              http_client=False, not_on={"http": "POST /v1/jobs"},
              request=SubmitRecords),
    Operation("check_submissions", "what submit_records would refuse, nothing entered (the HTTP API's own call, "
              "before it reads the jobs' rows)", "check_submissions", None,
              http_client=False, not_on={"http": "POST /v1/jobs asks it before reading the rows"},
              request=SubmitRecords),
    Operation("extend", "raise an ended or paused job's max_steps, epochs or both; it continues from its checkpoint",
              "extend", None,
              http_client=False, not_on={"http": "raise_budget, its user's form (`aspen run` again with the raised "
                                                 "budget, its own plan, calls this one)"},
              request=ExtendCall),
    Operation("raise_budget", "continue an ended or paused job to a larger max_steps, epochs or both, from its "
              "checkpoint", "extend", ("POST", "/v1/jobs/{job}/extend"), "extend",
              request=RaiseBudget, response=JobRecord),
    Operation("raise_max_steps", "raise_budget with max_steps alone", "extend", None,
              not_on={"http": "raise_budget's route, POST /v1/jobs/{job}/extend, with max_steps alone"},
              request=RaiseMaxSteps),
    Operation("wait_all", "block until every given job has ended", None, None, http_client=False,
              not_on={"http": "HttpClient.wait, one job at a time"},
              request=WaitAll),
    Operation("event_settings", "where to subscribe to the MQTT job events", None, None, http_client=False,
              not_on={"http": "read from the service's state folder, on its machine"}),
)

# the clients' own methods, not operations of the service: connecting, owning, closing
CLIENT_LIFECYCLE = {"connect", "local", "serve", "shutdown", "close", "handle"}


def by_name() -> dict[str, Operation]:
    return {operation.name: operation for operation in OPERATIONS}
