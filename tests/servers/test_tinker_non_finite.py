"""A diverged loop's NaN or infinite numbers reach the user of the real `tinker` SDK as the floats they are, rather
than as a server failure: a forward_backward whose loss is NaN or infinite, the optimizer step after it (its
`grad_norm:mean` NaN), and answers read by the SDK's own parsers (a future's JSON: orjson, which refuses the
NaN/Infinity tokens, then the SDK's pydantic types; a sample's protobuf: `deserialize_proto_response`). Before,
the optimizer step's answer failed to serialize (Starlette's JSONResponse refuses NaN): the SDK retried the 500
until the user gave up, never seeing the metric."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from actors.engine.tinker_sampling import Sampled, SampleResult
from orchestrator.tinker.answers import SdkJSONResponse, typed
from orchestrator.tinker.wire import write_samples
from tests.helpers.tinker_sdk import datums, tiny_api

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.lib._pydantic_conv import deserialize_json_response  # noqa: E402
from tinker.proto.response_conv import deserialize_proto_response  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

ADAM = types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
ROWS = [([1, 2, 3, 4], [2, 3, 4, 5], [1.0, 1.0, 1.0, 1.0])]


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tiny_api(tmp_path, {"alice-token": "alice"}, window_s=0.1) as served:
        yield served


def test_a_nan_loss_and_the_optimizer_step_after_it_reach_the_user_as_nan(server):
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")

    def blown(logprobs):   # a loss that diverged: NaN, whatever the log-probabilities
        return logprobs.sum() * float("nan"), {}

    handle = client.create_custom_loss(blown, {"logprobs": 1}).result()
    training = client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    output = training.forward_backward_custom(datums(ROWS), handle).result(timeout=60)
    assert math.isnan(output.metrics["loss:sum"])
    step = training.optim_step(ADAM).result(timeout=60)   # before: never answered (a 500 the SDK retries)
    assert math.isnan(step.metrics["grad_norm:mean"]), step.metrics
    client.close("success").result()


def test_an_infinite_loss_reaches_the_user_as_infinity(server):
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    tokens, targets, _ = ROWS[0]
    output = training.forward(datums([(tokens, targets, [float("inf")] * 4)]), "cross_entropy").result(timeout=60)
    # the reference: cross-entropy weighted by +inf is +inf (each -logprob is positive and finite)
    logprobs = output.loss_fn_outputs[0]["logprobs"].tolist()
    assert all(math.isfinite(value) and value < 0 for value in logprobs)
    assert output.metrics["loss:sum"] == math.inf
    client.close("success").result()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_future_s_json_with_a_non_finite_metric_is_read_by_the_sdk_as_the_float(value):
    """As the SDK reads a future's JSON answer (tinker/lib/api_future_impl.py: orjson, then the type)."""
    body = SdkJSONResponse(typed(types.OptimStepResponse, "optim_step", metrics={"m": value, "ok": 1.5})).body
    read = deserialize_json_response(orjson.loads(body), types.OptimStepResponse)
    assert read.metrics["ok"] == 1.5
    assert math.isnan(read.metrics["m"]) if math.isnan(value) else read.metrics["m"] == value


def test_a_sampled_token_s_minus_infinite_logprob_reaches_the_sdk_as_minus_infinity():
    """A sample's answer is protobuf (the SDK asks for it: PROTO_SUPPORTED_TYPES), which carries -inf as it is."""
    result = SampleResult(sequences=[Sampled(tokens=[5, 6], logprobs=[-math.inf, -0.5], stop_reason="length")])
    read = deserialize_proto_response(write_samples(result), types.SampleResponse)
    assert read.sequences[0].tokens == [5, 6]
    assert read.sequences[0].logprobs == [-math.inf, np.float32(-0.5)]


def test_sampling_from_an_adapter_whose_weights_went_nan_says_so_as_the_callers_error(server):
    """The optimizer step after a NaN loss leaves the adapter's weights NaN: sampling from them (temperature 1,
    torch's multinomial) failed with "sampling failed: RuntimeError('probability tensor contains either inf, nan
    or element < 0')", a server error that did not tell the user their weights diverged nor what to do. Now the
    SDK raises its error for a bad request (RequestFailedError, category user) saying so; the base alone, asked
    by the same user on the same server, still samples (the reference: the server is sound)."""
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")

    def blown(logprobs):
        return logprobs.sum() * float("nan"), {}

    handle = client.create_custom_loss(blown, {"logprobs": 1}).result()
    training = client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    training.forward_backward_custom(datums(ROWS), handle).result(timeout=60)
    step = training.optim_step(ADAM).result(timeout=60)
    sampler = training.save_weights_and_get_sampling_client("diverged")
    params = types.SamplingParams(max_tokens=3, temperature=1.0, stop=[])
    prompt = types.ModelInput.from_ints([1, 2, 3])
    with pytest.raises(tinker.RequestFailedError, match=r"the adapter's weights are not finite \((\d+) of \1 values "
                       r"are NaN or infinite.*load an earlier checkpoint.*lower learning rate") as raised:
        sampler.sample(prompt, 1, params).result(timeout=120)
    assert "probability tensor" not in str(raised.value)
    # since which step: the step's own answers the caller holds (the server does not track it; before: not said)
    assert math.isnan(step.metrics["grad_norm:mean"]) and "optim_step a NaN or infinite grad_norm:mean" in \
        str(raised.value), (step.metrics, str(raised.value))
    assert str(raised.value.category).lower().endswith("user"), raised.value.category   # not retried as a server's
    base = client.create_sampling_client(base_model="tiny-llama")
    (sequence,) = base.sample(prompt, 1, params).result(timeout=120).sequences
    assert len(sequence.tokens) == 3
    client.close("success").result()
