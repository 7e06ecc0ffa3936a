"""A Python client for the HTTP API (`aspen http`) that needs no Ray: the Ray client's methods (`submit`,
`submit_run`, `submit_many`, `jobs`, `status`, `losses`, `transitions`, `cancel`, `pause`, `resume`,
`wait`, `info`) over HTTP, plus `events()` (the server-sent event stream). Job records come back as the
Ray client's `JobRecord`s; a refusal is an `HttpApiError` carrying the server's status and message (a 404
is also a KeyError, an invalid spec also a `SpecError`, a state conflict also a ValueError, as the Ray
client raises them; a user's quota, a `QuotaExceeded`: wait `retry_after` seconds and try again).

    from orchestrator.http.api_client import HttpClient
    client = HttpClient("http://127.0.0.1:8765")            # token from $ASPEN_TOKEN or ~/.aspen/http-token
    job = client.submit({"name": "sql", "data": "/data/sql.jsonl", "format": {"type": "alpaca"}, "max_steps": 200})
    print(job.wait(timeout=3600).state, job.losses()[-1])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import httpx

from actors.service.table.job_table import JobRecord
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from actors.spec.sweep_spec import SweepSpec
from actors.storage.storage_uri import is_uri
from orchestrator.http.bridge import CALL_TIMEOUT_S
from orchestrator.http.request_bodies import as_request
from orchestrator.http.token import client_token
from orchestrator.job_handle import JobHandle, wait_until_ended
from orchestrator.jobs_file import SpecError, load_run_spec, output_dir_for_service, relative_output_dir

URL_ENV = "ASPEN_URL"
MAX_PAGE = 10_000   # jobs per request where HttpClient.jobs follows every page (the API's most: http/jobs.py)
DEFAULT_TIMEOUT_S = CALL_TIMEOUT_S + 10.0   # longer than the server waits for the service: its answer comes first


class HttpApiError(Exception):
    """The API refused a request (`status` 4xx) or could not serve it (5xx; 0: no connection). `detail` is
    the server's message, `errors` its per-field problems (an invalid spec)."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, Any]] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors or []

    def __str__(self) -> str:
        return self.detail


class Unauthorized(HttpApiError):
    """401: no token, or a wrong one."""


class JobNotFound(HttpApiError, KeyError):
    """404: no job with that id or name."""

    def __str__(self) -> str:   # KeyError would show the message quoted
        return self.detail


class SpecRefused(HttpApiError, SpecError):
    """422: the spec is invalid (or the body malformed); `errors` names each field. Nothing was submitted."""


class Conflict(HttpApiError, ValueError):
    """409: a name an unfinished job holds, or a job in the wrong state for the request."""


class QuotaExceeded(HttpApiError):
    """429: the request is fine, but its user's quota does not allow it now (their queued jobs, their tokens of the
    last 24 hours); the detail says which quota and what frees it. `retry_after`: the seconds to wait before trying
    again (the Retry-After header; for the daily tokens, until enough of them are 24 hours old); None for a quota
    of 0, which no wait frees (the detail says to ask an admin). Nothing was submitted or queued."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, Any]] | None = None, *,
                 retry_after: float | None = None):
        super().__init__(status, detail, errors)
        self.retry_after = retry_after


class ServiceUnavailable(HttpApiError):
    """503 (the service does not answer; the API server is up), or no connection to the API server (status 0)."""


_BY_STATUS = {401: Unauthorized, 404: JobNotFound, 409: Conflict, 422: SpecRefused, 503: ServiceUnavailable}


def _error(response: httpx.Response) -> HttpApiError:
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text.strip() or response.reason_phrase}
    detail = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(detail, str):
        detail = json.dumps(detail if detail is not None else body)
    errors = body.get("errors") if isinstance(body, dict) else None
    text = f"{detail} (HTTP {response.status_code})"
    if response.status_code == 429:
        return QuotaExceeded(429, text, errors, retry_after=_retry_after(response))
    kind = _BY_STATUS.get(response.status_code, ServiceUnavailable if response.status_code >= 500 else HttpApiError)
    return kind(response.status_code, text, errors)


def _retry_after(response: httpx.Response) -> float | None:
    """The Retry-After header's seconds (None: none, or an HTTP date, which this API does not send)."""
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


_RECORD_FIELDS = frozenset(field.name for field in fields(JobRecord))


class JobsPage(list):
    """A page of jobs (a list of `JobRecord`s); `next`: the cursor of the page after it (`jobs(after=...)`), None
    where this is the last."""

    def __init__(self, records: Iterable[JobRecord] = (), cursor: str | None = None):
        super().__init__(records)
        self.next = cursor


def _record(data: dict[str, Any]) -> JobRecord:
    """A job as the server sent it: fields this client does not know (a newer server's) are left out, and those
    an older server does not send take their defaults, so that clients and servers of other versions still talk."""
    return JobRecord(**{name: value for name, value in data.items() if name in _RECORD_FIELDS})


def _resolved_here(body: dict[str, Any]) -> dict[str, Any]:
    """A body whose relative `data` paths are made absolute against this process's folder, as the Ray client
    takes them (the service cannot know what they are relative to)."""
    def resolve(job: Any) -> Any:
        data = job.get("data") if isinstance(job, dict) else None
        if isinstance(data, str) and data.strip() and not is_uri(data) and not Path(data).expanduser().is_absolute():
            return {**job, "data": str(Path.cwd() / data)}
        return job

    if isinstance(body.get("jobs"), list):
        return {**body, "jobs": [resolve(job) for job in body["jobs"]]}
    return resolve(body)


def _job_path(job: str, suffix: str = "") -> str:
    return f"/v1/jobs/{quote(job, safe='')}{suffix}"


@dataclass(frozen=True)
class Event:
    """One server-sent event: `kind` (snapshot, transition, progress, error), its `data` (decoded JSON) and
    `id` (transitions: its number in the job table; resume after it with `events(after=...)`)."""

    kind: str
    data: Any
    id: str | None = None


class HttpJobHandle(JobHandle):
    """A submitted job, as the Ray client's `JobHandle` (the same class, asking the HTTP client)."""


class HttpClient:
    def __init__(self, url: str | None = None, token: str | None = None, *, token_file: str | Path | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, transport: httpx.BaseTransport | None = None):
        """`url`: the API (default `$ASPEN_URL`); `token`: default `$ASPEN_TOKEN`, else the token file's."""
        url = url or os.environ.get(URL_ENV)
        if not url:
            raise ValueError(f"no API URL: pass one (e.g. http://127.0.0.1:8765) or set ${URL_ENV}")
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                 headers={"Authorization": f"Bearer {token or client_token(token_file)}"})

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        response = self._response(method, path, **kwargs)
        return response.content if raw else response.json()

    def _response(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            why = str(error) or type(error).__name__
            raise ServiceUnavailable(0, f"the aspen HTTP API at {self.url} does not answer: {why}; is `aspen http` "
                                        "running there?") from None
        if response.is_error:
            raise _error(response)
        return response

    # -- the service --------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """The API's health (no token needed): raises ServiceUnavailable when the service does not answer."""
        return self._request("GET", "/v1/health")

    def info(self) -> dict[str, Any]:
        return self._request("GET", "/v1/service")

    # -- submitting ---------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec | JobSubmission | dict | str | Path, *, base_model: str | None = None,
               quantization: str | None = None, dtype: str | None = None,
               output_dir: str | Path | None = None) -> HttpJobHandle:
        """Submit one job: a dict of job fields, a `JobSpec`, a `JobSubmission`, or a jobs YAML file with one
        job. Paths are the service's machine's: a relative `data` is made absolute here (against this
        folder, or a file's folder), as the Ray client does. An invalid spec raises `SpecRefused` naming the
        field."""
        if isinstance(spec, (str, Path)):   # a file of several jobs refused before any is submitted
            run = load_run_spec(spec, check_files=False, for_a_service=True)
            if len(run.jobs) != 1:
                raise SpecError(f"{spec}: has {len(run.jobs)} jobs; submit it with submit_run() (or `aspen submit`) "
                                "to get one handle per job")
            return self.submit_run(spec)[0]
        if isinstance(spec, JobSubmission):
            base_model, quantization, dtype = spec.base_model, spec.quantization, spec.dtype
            output_dir = output_dir or spec.output_dir
            spec = spec.job.model_copy(update={"seed": spec.seed}) if spec.job.seed is None else spec.job
        body = as_request(spec, base_model=base_model, quantization=quantization, dtype=dtype, output_dir=output_dir)
        return self._submit(body)[0]

    def submit_run(self, run: RunSpec | str | Path) -> list[HttpJobHandle]:
        """Every job of a jobs YAML file (or `RunSpec`), all or none. Relative paths in a file are taken from
        its folder (here); the file's `output_dir`, where it sets one, holds one folder per job: a relative one
        under the service's output root (where it has none, from the file's folder, as the Ray client takes it)."""
        folder = Path.cwd()
        if not isinstance(run, RunSpec):
            folder = Path(run).expanduser().resolve().parent
            run = load_run_spec(run, check_files=False, for_a_service=True)   # the service checks its files
        if relative_output_dir(run):
            run = output_dir_for_service(run, folder, bool(self.info().get("output_root")))
        return self._submit(as_request(run))

    def submit_many(self, specs: Iterable[JobSpec | dict], **run_settings: Any) -> list[HttpJobHandle]:
        """Several jobs with the same run settings (base_model, quantization, dtype), all or none."""
        jobs = [as_request(spec) for spec in specs]
        return self._submit(as_request({"jobs": jobs}, **run_settings))

    def _submit(self, body: dict[str, Any]) -> list[HttpJobHandle]:
        answer = self._request("POST", "/v1/jobs", json=_resolved_here(body))
        return [HttpJobHandle(self, job["id"], job["name"]) for job in answer["jobs"]]

    # -- sweeps -------------------------------------------------------------------------------------------
    def sweep(self, spec: SweepSpec | dict | str | Path) -> dict[str, Any]:
        """`Client.sweep` over HTTP: a sweep file's path (read and checked here) or a dict of its fields (checked
        by the service: its refusal, a `SpecRefused`, names the field), relative paths resolved here."""
        from orchestrator.sweep import load_sweep_spec

        if isinstance(spec, (str, Path)):
            body = load_sweep_spec(spec).model_dump(mode="json", exclude_unset=True)
        elif isinstance(spec, dict):
            body = dict(spec)
            if isinstance(body.get("job"), dict):
                body["job"] = _resolved_here(body["job"])
            if isinstance(body.get("output_dir"), str) and not is_uri(body["output_dir"]):
                body["output_dir"] = str(Path.cwd() / Path(body["output_dir"]).expanduser())
        else:
            body = spec.model_dump(mode="json", exclude_unset=True)   # a SweepSpec
        return self._request("POST", "/v1/sweeps", json=body)

    def sweep_status(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/sweeps/{quote(name, safe='')}")

    def sweeps(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/sweeps")

    def accounts(self) -> list[dict[str, Any]]:
        """What your jobs used (an admin: every user's): jobs, tokens, step_seconds, gpu_seconds."""
        return self._request("GET", "/v1/accounts")

    def cancel_sweep(self, name: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/sweeps/{quote(name, safe='')}/cancel")

    # -- following ----------------------------------------------------------------------------------------
    def jobs(self, states: Iterable[str] | None = None, limit: int | None = None,
             after: str | None = None) -> JobsPage:
        """Your jobs (an admin: everyone's), oldest first, or those in `states`. Without `limit` and `after`: every
        one, the API's pages followed; with them, one page of at most `limit` after the cursor `after`, its `next`
        the cursor of the page after it (None: this was the last)."""
        states = list(states or ())
        if limit is None and after is None:
            found, page = JobsPage(), self.jobs(states, MAX_PAGE)
            found.extend(page)
            while page.next is not None:
                page = self.jobs(states, MAX_PAGE, page.next)
                found.extend(page)
            return found
        params = [("state", state) for state in states]
        params += [(key, str(value)) for key, value in (("limit", limit), ("after", after)) if value is not None]
        response = self._response("GET", "/v1/jobs", params=params)
        next_link = response.links.get("next", {}).get("url")
        cursor = dict(parse_qsl(urlsplit(next_link).query)).get("after") if next_link else None
        return JobsPage((_record(job) for job in response.json()), cursor)

    def status(self, job: str) -> JobRecord:
        return _record(self._request("GET", _job_path(job)))

    def handle(self, job: str) -> HttpJobHandle:
        record = self.status(job)
        return HttpJobHandle(self, record.id, record.name)

    def losses(self, job: str) -> list[dict[str, Any]]:
        return self._request("GET", _job_path(job, "/losses"))

    def transitions(self, job: str) -> list[tuple[float, str, str]]:
        rows = self._request("GET", _job_path(job, "/transitions"))
        return [(row["time"], row["state"], row["reason"]) for row in rows]

    def export(self, job: str, out: str | Path | None = None, *, checkpoint: bool = False,
               force: bool = False) -> Path:
        """Write the job's adapter (`checkpoint`: its last checkpoint's) as a PEFT folder at `out` (default
        `./<job name>-lora`), fetched from the service (`GET /v1/jobs/{job}/adapter`); returns the folder.
        Conflict (409) where the job has no adapter yet, with the reason."""
        from orchestrator.export import unpack_adapter

        record = self.status(job)
        out = Path(out) if out is not None else Path.cwd() / f"{record.name}-{'checkpoint' if checkpoint else 'lora'}"
        archive = self._request("GET", _job_path(record.id, "/adapter"), raw=True,
                                params={"checkpoint": "true"} if checkpoint else None)
        return unpack_adapter(archive, out, force=force)

    def cancel(self, job: str) -> JobRecord:
        return _record(self._request("POST", _job_path(job, "/cancel")))

    def pause(self, job: str) -> JobRecord:
        return _record(self._request("POST", _job_path(job, "/pause")))

    def resume(self, job: str) -> JobRecord:
        return _record(self._request("POST", _job_path(job, "/resume")))

    def raise_max_steps(self, job: str, max_steps: int) -> JobRecord:
        """`raise_budget` with `max_steps` alone."""
        return self.raise_budget(job, max_steps=max_steps)

    def raise_budget(self, job: str, max_steps: int | None = None, epochs: float | None = None) -> JobRecord:
        """Continue an ended or paused job to `max_steps`, `epochs` or both, from its last checkpoint
        (`Client.raise_budget`)."""
        body = {name: value for name, value in (("max_steps", max_steps), ("epochs", epochs)) if value is not None}
        return _record(self._request("POST", _job_path(job, "/extend"), json=body))

    def generate(self, job: str, prompt: str, max_new_tokens: int = 64) -> dict[str, Any]:
        """"Try it": `prompt` continued by the job's adapter (a running job's current one, a finished job's final one)
        and by the base alone (`Client.generate`); `Conflict` for a job with neither."""
        return self._request("POST", _job_path(job, "/generate"), json={"prompt": prompt,
                                                                        "max_new_tokens": max_new_tokens})

    def spec(self, job: str) -> dict[str, Any]:
        """The job's spec as a jobs file that submits it again: `{"yaml": text, "jobs_file": data}`."""
        return self._request("GET", _job_path(job, "/spec"))

    def serving(self, job: str) -> dict[str, Any]:
        """The lines that serve the job's adapter with vLLM (`vllm`) and load it with PEFT (`peft`) on the
        service's machine, and what to change elsewhere (`elsewhere`)."""
        return self._request("GET", _job_path(job, "/serving"))

    def generations(self, job: str, step: int | None = None) -> dict[str, Any]:
        """An eval_generate evaluation of the job (the last, or the one after `step`): {steps, step, rows}, each
        row its prompt, reference, the adapter's prediction and score."""
        return self._request("GET", _job_path(job, "/generations"), params={} if step is None else {"step": step})

    def wait(self, job: str, timeout: float | None = None, poll: float = 0.5) -> JobRecord:
        """Block until the job has ended (completed, stopped early, failed or cancelled)."""
        return wait_until_ended(self.status, job, timeout, poll)

    def events(self, *, job: str | None = None, progress: bool = False, after: int | str | None = None,
               timeout: float | None = None) -> Iterator[Event]:
        """The event stream (`GET /v1/events`) as it arrives: without `after`, first a `snapshot` of the jobs;
        then a `transition` per state change (with `after`: every one after that event id), `progress` per
        step with `progress=True`, `error` while the service does not answer. Ends when the caller stops
        iterating (or after `timeout` seconds without a byte, keep-alives included)."""
        params: dict[str, Any] = {"progress": "true"} if progress else {}
        if job:
            params["job"] = job
        headers = {"Last-Event-ID": str(after)} if after is not None else {}
        try:
            with self.http.stream("GET", "/v1/events", params=params, headers=headers,
                                  timeout=httpx.Timeout(self.http.timeout.connect, read=timeout)) as response:
                if response.is_error:
                    response.read()
                    raise _error(response)
                yield from _parse_events(response.iter_lines())
        except httpx.TransportError as error:
            raise ServiceUnavailable(0, f"the event stream of {self.url} broke off: {error or type(error).__name__}") \
                from None


def _parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """Server-sent events (the WHATWG format: `event:`, `data:`, `id:` lines, a blank line ends one; `:`
    lines are comments)."""
    kind, data, event_id = "message", [], None
    for line in lines:
        if not line:
            if data:
                yield Event(kind, json.loads("\n".join(data)), event_id)
            kind, data, event_id = "message", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            kind = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            event_id = value
