"""A training client's seed through the real `tinker` SDK: without one (the SDK documents None as a random seed)
each model starts from LoRA A weights of its own (all started from seed 0's before); the same seed gives the same
weights; the seed drawn is kept in the run's folder, and passing it again, or resuming from a saved state, gives
the run's weights again."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator.tinker.rest_routes import RUN_FILE
from tests.helpers.tinker_api import BASE, saved_weights

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why


def initial(backend, training, name: str) -> dict[str, torch.Tensor]:
    """The adapter a training client holds now, as its save_weights_for_sampler wrote it."""
    return saved_weights(backend, training.save_weights_for_sampler(name).result().path)


def a_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    found = {name: tensor for name, tensor in weights.items() if "lora_A" in name}
    assert found, sorted(weights)[:5]
    return found


def same(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> bool:
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def test_seedless_clients_start_apart_and_a_seed_or_a_saved_state_repeats_a_run(sdk_server):
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    first = client.create_lora_training_client(base_model=BASE, rank=4).result()
    second = client.create_lora_training_client(base_model=BASE, rank=4).result()
    first_a, second_a = a_weights(initial(backend, first, "init")), a_weights(initial(backend, second, "init"))
    assert first_a.keys() == second_a.keys()
    assert not any(torch.equal(first_a[k], second_a[k]) for k in first_a)   # each layer's A its own

    sevens = [client.create_lora_training_client(base_model=BASE, rank=4, seed=7).result() for _ in range(2)]
    assert same(initial(backend, sevens[0], "init"), initial(backend, sevens[1], "init"))
    assert not same(a_weights(initial(backend, sevens[0], "again")), first_a)

    # the drawn seed is kept with the run: asked again, it gives the run's weights
    drawn = json.loads((backend.folder(first.model_id) / RUN_FILE).read_text())["seed"]
    again = client.create_lora_training_client(base_model=BASE, rank=4, seed=drawn).result()
    assert same(a_weights(initial(backend, again, "init")), first_a)

    # a resumed run (save_state, then a new client from it) starts from the run's weights
    state = first.save_state("start").result().path
    resumed = client.create_training_client_from_state(state).result()
    assert same(a_weights(initial(backend, resumed, "init")), first_a)
    client.close("success").result()
