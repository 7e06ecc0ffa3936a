"""Shared fixtures: `scenario`, a trainer loop and a scheduler core driving a MetricsListener, its /metrics page
scraped during and after (tests/helpers/metrics_scenario.py; one per test module that asks); `memorising_model`,
a tiny llama an adapter makes confident fast (early stop, keep_best)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.metrics_scenario import Scenario, metrics_scenario
from tests.helpers.models import tiny_model


@pytest.fixture(scope="module")
def scenario(tiny_model_dirs, tmp_path_factory) -> Iterator[Scenario]:
    with metrics_scenario(tiny_model_dirs, tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="session")
def memorising_model(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny random llama with a 20x larger output layer: its logits can get confident enough for an adapter to
    drive the loss of a memorised example near 0 (with the usual 0.02 init they cannot), and to overfit: its
    held-out rows' loss rises again as its training rows' answers are memorised."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    folder = tmp_path_factory.mktemp("memorising-llama")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder
