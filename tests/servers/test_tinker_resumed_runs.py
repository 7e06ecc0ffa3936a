"""A training run created from another run's saved state (create_training_client_from_state[_with_optimizer]),
through the real `tinker` SDK: its run file records what reproduces it, and it continues as the original run does
(the reference: the original itself, trained on with the same calls)."""

from __future__ import annotations

import json

import pytest
import torch

from actors.engine.models import from_module
from orchestrator.tinker.rest_routes import RUN_FILE
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import datums, tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import ADAM, BASE, KEYS, WINDOW_S, batch, saved_weights, train_steps  # noqa: E402


def continued(training, backend) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two more steps of `training`: their losses, and the weights it then saves for sampling (as written)."""
    losses = []
    for seed in (2, 3):
        losses.append(training.forward_backward(datums(batch(seed)), "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result()
    return losses, saved_weights(backend, training.save_weights_for_sampler("continued").result().path)


def same(run, reference) -> bool:
    (losses, weights), (reference_losses, reference_weights) = run, reference
    return losses == reference_losses and weights.keys() == reference_weights.keys() and all(
        torch.equal(weights[name], reference_weights[name]) for name in weights)


def test_a_run_created_from_a_state_records_its_origin_and_seed_and_continues_as_the_original(sdk_server):
    """A run created from a state with its optimizer continues, loss for loss and bit for bit, as the original
    run trained on from that state. Its training_run.json names the state, that the optimizer's state was
    loaded, and the seed the original's weights started from (it had no run file: nothing said where it came
    from); on a restarted server that record alone reproduces the continuation."""
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    original = client.create_lora_training_client(base_model=BASE, rank=4).result()   # seed None: one drawn
    train_steps(original, (1,))
    state = original.save_state("step-1").result().path
    resumed = client.create_training_client_from_state_with_optimizer(state).result()
    plain = client.create_training_client_from_state(state).result()
    reference = continued(original, backend)
    assert same(continued(resumed, backend), reference)
    original_seed = json.loads((backend.folder(original.model_id) / RUN_FILE).read_text())["seed"]
    record = json.loads((backend.folder(resumed.model_id) / RUN_FILE).read_text())
    assert record == {"user": "alice", "user_metadata": None, "seed": original_seed, "from_state": state,
                      "with_optimizer": True}
    assert json.loads((backend.folder(plain.model_id) / RUN_FILE).read_text())["with_optimizer"] is False
    client.close("success").result()

    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, backend.weights_dir, KEYS.get,
                           window_s=WINDOW_S) as (restarted, restarted_backend, _):
        again = tinker.ServiceClient(base_url=restarted, api_key="tml-alice-token")
        create = (again.create_training_client_from_state_with_optimizer if record["with_optimizer"]
                  else again.create_training_client_from_state)
        assert same(continued(create(record["from_state"]).result(), restarted_backend), reference)
        again.close("success").result()
