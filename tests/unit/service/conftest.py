"""The metrics tests' shared fixture: `scenario`, a trainer loop and a scheduler core driving a MetricsListener,
its /metrics page scraped during and after (tests/helpers/metrics_scenario.py; one per test module that asks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.metrics_scenario import Scenario, metrics_scenario


@pytest.fixture(scope="module")
def scenario(tiny_model_dirs, tmp_path_factory) -> Iterator[Scenario]:
    with metrics_scenario(tiny_model_dirs, tmp_path_factory) as running:
        yield running
