"""The servers' shared fixtures: `api`, the HTTP API on a real uvicorn server over a real service on the
session's Ray (one per test module that asks for it), and `users`, its service's users file; `sdk_server` and
`ledger_clock`, the Tinker API served in the test's process and its checkpoint ledger's clock
(tests/helpers/tinker_api.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from actors.service.accounts.users import UserBook
from tests.helpers.http_server import Api, served_api


@pytest.fixture(scope="module")
def api(ray_session, tiny_model_dirs, tmp_path_factory) -> Iterator[Api]:
    with served_api(ray_session.get_runtime_context().gcs_address, str(tiny_model_dirs["llama"]),
                    tmp_path_factory) as served:
        yield served


@pytest.fixture()
def users(api) -> Iterator[UserBook]:
    """The service's users file (its state folder's: the scheduler checks each job's user and data there),
    removed after the test."""
    book = UserBook.in_state_dir(api.state_dir)
    try:
        yield book
    finally:
        book.path.unlink(missing_ok=True)


@pytest.fixture
def sdk_server(tmp_path, monkeypatch):
    from tests.helpers.tinker_api import served_tiny_base  # here: the engine and the SDK only where asked for

    with served_tiny_base(tmp_path, monkeypatch) as served:
        yield served


@pytest.fixture
def ledger_clock(monkeypatch) -> list[float]:
    from tests.helpers.tinker_api import movable_ledger_clock

    return movable_ledger_clock(monkeypatch)
