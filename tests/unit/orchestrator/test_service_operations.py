"""The service's operations against their catalogue (orchestrator/service_operations.py): every surface has each
operation the catalogue puts on it (the scheduler actor's method, the Ray client's, the HTTP route, the
HttpClient's, the aspen command), and nothing is on a surface the catalogue does not know of."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

from actors.scheduler_actor import SchedulerActor
from orchestrator.cli.parser import build_parser
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.api_client import HttpClient
from orchestrator.service_calls import ServiceLink
from orchestrator.service_operations import CLIENT_LIFECYCLE, OPERATIONS, by_name

pytestmark = pytest.mark.unit


def public_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("_") and callable(value)}


def routes() -> set[tuple[str, str]]:
    app = create_app(ServiceLink(client=None), "t" * 20, console=False)
    return {(method.upper(), path) for path, methods in app.openapi()["paths"].items() for method in methods}


def commands() -> set[str]:
    parser = build_parser()
    (sub,) = [action for action in parser._actions if action.dest == "command"]
    return set(sub.choices)


def test_every_surface_has_the_operations_the_catalogue_puts_on_it():
    scheduler = {name for name in dir(SchedulerActor.__ray_actor_class__) if not name.startswith("_")}
    http_routes, cli = routes(), commands()
    missing = []
    for op in OPERATIONS:
        if op.scheduler and op.scheduler not in scheduler:
            missing.append(f"{op.name}: SchedulerActor.{op.scheduler}")
        if op.ray and not hasattr(Client, op.name):
            missing.append(f"{op.name}: Client.{op.name}")
        if op.http_client and not hasattr(HttpClient, op.name):
            missing.append(f"{op.name}: HttpClient.{op.name}")
        if op.http and op.http not in http_routes:
            missing.append(f"{op.name}: {op.http[0]} {op.http[1]}")
        if op.cli and op.cli not in cli:
            missing.append(f"{op.name}: aspen {op.cli}")
        for surface, why in op.not_on.items():
            assert surface in ("ray", "http", "http_client") and why, (op.name, surface)
    assert not missing, missing


def test_nothing_is_on_a_surface_the_catalogue_does_not_know():
    known = by_name()
    unknown = [f"Client.{name}" for name in public_methods(Client) - CLIENT_LIFECYCLE if name not in known]
    unknown += [f"HttpClient.{name}" for name in public_methods(HttpClient) - CLIENT_LIFECYCLE if name not in known]
    catalogued = {op.http for op in OPERATIONS if op.http}
    unknown += [f"{method} {path}" for method, path in routes() if (method, path) not in catalogued]
    assert not unknown, f"add these to orchestrator/service_operations.py (or remove them): {unknown}"
    # an operation the catalogue keeps off a surface is really not there (or the catalogue is stale)
    for op in OPERATIONS:
        assert op.ray or not hasattr(Client, op.name), f"Client.{op.name} exists: set ray=True for it"
        assert op.http_client or not hasattr(HttpClient, op.name), f"HttpClient.{op.name} exists"


def operation_schema(app_schema: dict, path: str, method: str) -> tuple[set[str], dict | None]:
    """The route's parameter names (path, query, and the JSON body's fields) and its 2xx JSON answer's schema."""
    route = app_schema["paths"][path][method.lower()]
    names = {p["name"] for p in route.get("parameters", []) if p["in"] in ("path", "query")}
    body = route.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in body:
        names |= set(app_schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]["properties"])
    answers = [r for status, r in route["responses"].items() if status.startswith("2")]
    answer = answers[0].get("content", {}).get("application/json", {}).get("schema") if answers else None
    return names, answer


def answered(schema: dict | None) -> Any:
    """A route's answer as a shape: a model's name, or ("list", the item's shape)."""
    if schema is None:
        return None
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[1]
    if schema.get("type") == "array":
        return ("list", answered(schema.get("items")))
    return {k: v for k, v in schema.items() if k != "title"}


def declared(kind: Any) -> Any:
    """The catalogue's response as the same shape."""
    if typing.get_origin(kind) is list:
        return ("list", declared(typing.get_args(kind)[0]))
    return kind.__name__


def test_every_surface_takes_the_operations_request_and_the_routes_answer_its_response():
    """The clients' methods take the request's fields (more only as options with defaults), the HTTP route's
    parameters are the request's fields (by their HTTP names), a spec argument is typed as that spec, and the
    route answers the response's schema."""
    app_schema = create_app(ServiceLink(client=None), "t" * 20, console=False).openapi()
    wrong = []
    for op in OPERATIONS:
        methods = [getattr(cls, op.name) for cls, on in ((Client, op.ray), (HttpClient, op.http_client)) if on]
        for method in methods:
            params = list(inspect.signature(method).parameters.values())[1:]
            where = f"{method.__qualname__}{inspect.signature(method)}"
            if op.spec_argument:
                if not params or op.request.__name__ not in str(params[0].annotation):
                    wrong.append(f"{op.name}: {where} does not take a {op.request.__name__} first")
                continue
            fields = set(op.request.model_fields) if op.request else set()
            names = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            if fields - names:
                wrong.append(f"{op.name}: {where} lacks {sorted(fields - names)} of {op.request.__name__}")
            required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD,
                                                                                         p.VAR_POSITIONAL)}
            if required - fields:
                wrong.append(f"{op.name}: {where} requires {sorted(required - fields)}, not in the request")
        if op.http is None:
            continue
        names, answer = operation_schema(app_schema, op.http[1], op.http[0])
        if not op.spec_argument:
            fields = op.request.model_fields if op.request else {}
            http_names = {info.alias or name for name, info in fields.items()
                          if not (info.json_schema_extra or {}).get("http_header")}
            if names != http_names:
                wrong.append(f"{op.name}: {op.http[0]} {op.http[1]} takes {sorted(names)}, the request "
                             f"{sorted(http_names)}")
        if op.response is not None:
            if answered(answer) != declared(op.response):
                wrong.append(f"{op.name}: {op.http[1]} answers {answer}, not {op.response}")
    assert not wrong, "\n".join(wrong)


def test_the_request_and_response_check_finds_a_drift():
    """The check above, on a drifted surface: a client method without the request's `job`."""
    class Drifted:
        def status(self, name: str) -> None: ...

    params = list(inspect.signature(Drifted.status).parameters.values())[1:]
    assert set(by_name()["status"].request.model_fields) - {p.name for p in params} == {"job"}
