"""The service's operations against their catalogue (orchestrator/service_operations.py): every surface has each
operation the catalogue puts on it (the scheduler actor's method, the Ray client's, the HTTP route, the
HttpClient's, the aspen command), and nothing is on a surface the catalogue does not know of."""

from __future__ import annotations

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
