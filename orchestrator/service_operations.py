"""The service's operations, each defined once: what it does, the scheduler actor's method that does it, and
where users reach it (the Ray `Client`, the HTTP API's route, the `HttpClient`, the `aspen` command). The
surfaces are checked against this catalogue (tests/unit/orchestrator/test_operations.py): a surface that
lacks an operation the catalogue gives it fails, as does a route, client method or command the catalogue
does not know. Adding an operation is one entry here plus its implementation on each surface it names.

A surface an operation is not on says why (`not_on`): e.g. the event stream is HTTP's (the Ray client reads
the job table's transitions by number instead), deleting a job is an operator's (Ray only)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


OPERATIONS: tuple[Operation, ...] = (
    Operation("info", "the service's description: state folder, policy, trainers, URLs", "info",
              ("GET", "/v1/service")),
    Operation("submit", "submit one job (a spec, a dict of its fields, or a one-job jobs file)", "submit",
              ("POST", "/v1/jobs"), "submit"),
    Operation("submit_run", "submit every job of a jobs file, all or none", "submit_many", ("POST", "/v1/jobs"),
              "submit"),
    Operation("submit_many", "submit several jobs together, all or none", "submit_many", ("POST", "/v1/jobs")),
    Operation("jobs", "every job (or those in the given states)", "jobs", ("GET", "/v1/jobs"), "status"),
    Operation("status", "one job, by id or by a name only one job has", "status", ("GET", "/v1/jobs/{job}"),
              "status"),
    Operation("losses", "a job's rows, one per optimizer step", "progress", ("GET", "/v1/jobs/{job}/losses"),
              "losses"),
    Operation("transitions", "a job's state history", "transitions", ("GET", "/v1/jobs/{job}/transitions")),
    Operation("cancel", "cancel a job (checkpointed first)", "cancel", ("POST", "/v1/jobs/{job}/cancel"), "cancel"),
    Operation("pause", "pause a job (checkpointed)", "pause", ("POST", "/v1/jobs/{job}/pause"), "pause"),
    Operation("resume", "queue a paused, failed or cancelled job again", "resume", ("POST", "/v1/jobs/{job}/resume"),
              "resume"),
    Operation("generate", "\"try it\": a prompt continued by a running job's adapter and by the base", "generate",
              ("POST", "/v1/jobs/{job}/generate")),
    Operation("export", "a job's adapter as a PEFT folder", None, ("GET", "/v1/jobs/{job}/adapter"), "export"),
    Operation("spec", "a job's spec as a jobs file that submits it again", "submission", ("GET", "/v1/jobs/{job}/spec"),
              ray=False, not_on={"ray": "Client.submission gives the JobSubmission itself"}),
    Operation("serving", "the vLLM and PEFT lines for a job's adapter on the service's machine", None,
              ("GET", "/v1/jobs/{job}/serving"), ray=False,
              not_on={"ray": "a Ray client runs on a machine of the cluster: aspen export prints the lines there"}),
    Operation("wait", "block until a job has ended", None, None,
              not_on={"http": "the clients poll status (or follow /v1/events)"}),
    Operation("sweep", "start a sweep (or find the same one running)", "sweep", ("POST", "/v1/sweeps"), "sweep"),
    Operation("sweeps", "every sweep with its leaderboard", "sweeps_list", ("GET", "/v1/sweeps")),
    Operation("sweep_status", "one sweep: state, trials, best", "sweep", ("GET", "/v1/sweeps/{name}"), "sweep"),
    Operation("cancel_sweep", "start no more trials and cancel the running ones", "cancel_sweep",
              ("POST", "/v1/sweeps/{name}/cancel")),
    Operation("accounts", "what each user's jobs used", "accounts", ("GET", "/v1/accounts")),
    Operation("events", "server-sent events: every job state change, steps", "transitions_after",
              ("GET", "/v1/events"), ray=False,
              not_on={"ray": "Client.transitions_after reads the same transitions by number"}),
    Operation("health", "is the API up, does the service answer (no token)", "info", ("GET", "/v1/health"),
              ray=False, not_on={"ray": "a Ray client's call either answers or raises"}),
    Operation("whoami", "who the token is", None, ("GET", "/v1/whoami"), ray=False, http_client=False,
              not_on={"ray": "Ray has no users", "http_client": "the console's; HttpClient users know their token"}),
    Operation("audit", "the audit log (admins)", None, ("GET", "/v1/audit"), ray=False, http_client=False,
              not_on={"ray": "an operator reads audit.jsonl", "http_client": "not yet: curl or the console"}),
    Operation("delete", "remove an ended job and its history from the table", "delete", None, http_client=False,
              not_on={"http": "an operator's (aspen run --overwrite uses it)"}),
    Operation("submission", "a job's stored submission", "submission", None, http_client=False,
              not_on={"http": "GET /v1/jobs/{job}/spec answers it as a jobs file"}),
    Operation("transitions_after", "the job table's transitions after a number", "transitions_after", None,
              http_client=False, not_on={"http": "GET /v1/events streams them"}),
    Operation("trainers", "each trainer's status", "trainers", None, http_client=False,
              not_on={"http": "GET /v1/service has them"}),
    Operation("wait_ready", "block until every trainer has set up", "wait_ready", None, http_client=False,
              not_on={"http": "a service behind the API is already up"}),
    Operation("submit_records", "submit checked submissions (the HTTP API's own call)", "submit_many", None,
              http_client=False, not_on={"http": "POST /v1/jobs"}),
    Operation("wait_all", "block until every given job has ended", None, None, http_client=False,
              not_on={"http": "HttpClient.wait, one job at a time"}),
    Operation("event_settings", "where to subscribe to the MQTT job events", None, None, http_client=False,
              not_on={"http": "read from the service's state folder, on its machine"}),
)

# the clients' own methods, not operations of the service: connecting, owning, closing
CLIENT_LIFECYCLE = {"connect", "local", "serve", "shutdown", "close", "handle"}


def by_name() -> dict[str, Operation]:
    return {operation.name: operation for operation in OPERATIONS}
