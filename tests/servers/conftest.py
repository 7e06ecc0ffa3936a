"""The servers' shared fixture: `api`, the HTTP API on a real uvicorn server over a real service on the
session's Ray (one per test module that asks for it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.http_server import Api, served_api


@pytest.fixture(scope="module")
def api(ray_session, tiny_model_dirs, tmp_path_factory) -> Iterator[Api]:
    with served_api(ray_session.get_runtime_context().gcs_address, str(tiny_model_dirs["llama"]),
                    tmp_path_factory) as served:
        yield served
