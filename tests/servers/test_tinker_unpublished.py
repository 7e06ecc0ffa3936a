"""Sampler weights their owner unpublished, through the real `tinker` SDK: another user's sampling client opened
on them while they were published stops sampling them (it went on; its sampling session did not look again), and
is answered as a fresh client of theirs is for that path: its status and text. While its model lives (its frozen
copy sampled) and after it ended (the saved files read back)."""

from __future__ import annotations

import pytest

from tests.helpers.tinker_api import BASE, greedy, train_steps

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
PROMPT = [5, 17, 3]


def refusal(ask) -> tuple[str, int, str]:
    with pytest.raises(tinker.APIStatusError) as raised:
        ask()
    return type(raised.value).__name__, raised.value.status_code, str(raised.value)


@pytest.mark.parametrize("model_ended", [False, True])
def test_a_sampler_on_unpublished_weights_stops_as_a_fresh_one_is_refused(sdk_server, model_ended):
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    train_steps(training, (1,))
    path = training.save_weights_for_sampler("shared").result().path
    if model_ended:
        alice.close("success").result()
        alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    rest = alice.create_rest_client()
    rest.publish_checkpoint_from_tinker_path(path).result()
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bobs = bob.create_sampling_client(model_path=path)
    owners = greedy(alice.create_sampling_client(model_path=path), PROMPT)
    assert greedy(bobs, PROMPT).sequences[0].tokens == owners.sequences[0].tokens

    rest.unpublish_checkpoint_from_tinker_path(path).result()
    fresh = refusal(lambda: greedy(bob.create_sampling_client(model_path=path), PROMPT))
    assert fresh[1] == 404
    assert refusal(lambda: greedy(bobs, PROMPT)) == fresh
    assert greedy(alice.create_sampling_client(model_path=path), PROMPT).sequences[0].tokens == \
        owners.sequences[0].tokens   # its owner samples it still

    rest.publish_checkpoint_from_tinker_path(path).result()   # published again: Bob's client samples it again
    assert greedy(bobs, PROMPT).sequences[0].tokens == owners.sequences[0].tokens
    alice.close("success").result()
    bob.close("success").result()
