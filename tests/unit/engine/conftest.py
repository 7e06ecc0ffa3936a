"""Fixtures of the engine's unit tests, besides tests/conftest.py's."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture()
def tok(smol_tokenizer) -> Any:
    """SmolLM2's real tokenizer (tests/conftest.py's smol_tokenizer, read once a session), under the name the data
    tests (test_data_formats.py, test_data_files.py) give it."""
    return smol_tokenizer
