"""The Tinker API (orchestrator/tinker/) served by uvicorn, driven by the real `tinker` SDK as its users run
it: a supervised loop (forward_backward with cross_entropy, optim_step) trains an adapter equal, bit for bit,
to the same calls made on aspen's engine in this process; two users' loops at once share fused passes and each
sees only their own models; forward_backward_custom (the SDK computes the loss from the logprobs) trains as
cross_entropy does; a datum the base cannot take fails that user's call alone; sampling from saved weights
gives what aspen's sampler gives on the same weights (greedy: the same tokens; a seed: the same samples
again); a session that stops beating ends, and its models leave the base."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name
from orchestrator.tinker.tinker_routes import TinkerBackend
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import datums, tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

BASE = "tiny-llama"
WINDOW_S = 0.25   # how long a call waits for partners: wide, so that two users' calls sent together meet
KEYS = {"alice-token": "alice", "bob-token": "bob"}
ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, tmp_path / "weights", KEYS.get,
                           window_s=WINDOW_S) as served:
        yield served


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The checkpoint ledger's clock, which a test moves (clock[0] += seconds)."""
    from orchestrator.tinker import checkpoint_ledger

    moment = [time.time()]
    monkeypatch.setattr(checkpoint_ledger, "now", lambda: moment[0])
    return moment


def batch(seed: int, count: int = 2) -> list[tuple[list[int], list[int], list[float]]]:
    generator = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        length = int(generator.integers(5, 20))
        tokens = generator.integers(0, VOCAB, length).tolist()
        targets = generator.integers(0, VOCAB, length).tolist()
        weights = (generator.random(length) > 0.2).astype(np.float32).tolist()
        rows.append((tokens, targets, weights))
    return rows


def sdk_loop(url: str, key: str, seeds: list[int], *, custom: bool = False,
             together: threading.Barrier | None = None) -> tuple[str, list[float], str]:
    """The user's loop through the SDK: its model id, its losses, and the path of its final weights.
    `together`: each step starts when every loop that shares the barrier is at it."""
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    losses = []
    for seed in seeds:
        if together is not None:
            together.wait(timeout=60)
        data = datums(batch(seed))
        if custom:
            def loss_fn(data, logprobs):
                total = sum((-lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum()
                            for d, lp in zip(data, logprobs, strict=True))
                return total, {"custom_loss:sum": float(total.detach())}

            result = training.forward_backward_custom(data, loss_fn).result()
            losses.append(result.metrics["custom_loss:sum"])
        else:
            result = training.forward_backward(data, "cross_entropy").result()
            losses.append(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result()
    saved = training.save_weights_for_sampler("final").result()
    model_id = training.model_id
    client.close("success").result()
    return model_id, losses, saved.path


def train_steps(training, seeds) -> None:
    for seed in seeds:
        training.forward_backward(datums(batch(seed)), "cross_entropy").result()
        training.optim_step(types.AdamParams(**ADAM)).result()


def engine_reference(seeds: list[int]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same calls on aspen's engine in this process, on a fresh copy of the base."""
    base = from_module(tiny_model("llama", VOCAB), None)
    model = InteractiveModel(base, adapter_name("reference"), 4, train_unembed=True)   # the SDK's default
    losses = []
    for seed in seeds:
        rows = [CallDatum(tuple(tokens), {"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)})
                for tokens, targets, weights in batch(seed)]
        (output,) = run_calls(base, [ModelCall(model.name, tuple(rows))], backward=True)
        losses.append(output.loss_sum)
        model.optim_step(AdamStep(**ADAM))
    return adapter_state_dict(model.adapter), losses


def saved_weights(backend: TinkerBackend, path: str) -> dict[str, torch.Tensor]:
    """The adapter a `tinker://<model>/sampler_weights/<name>` path names, as written (PEFT's files)."""
    model_id, _, name = path.removeprefix("tinker://").split("/")
    folder = backend.weights_dir / model_id.replace(":", "-") / "sampler_weights" / name
    return load_file(folder / "adapter_model.safetensors")


def test_the_sdks_supervised_loop_trains_what_the_engine_trains_bit_for_bit(server):
    url, backend, _ = server
    seeds = [1, 2, 3]
    model_id, losses, path = sdk_loop(url, "alice-token", seeds)
    expected, expected_losses = engine_reference(seeds)
    assert losses == expected_losses
    weights = saved_weights(backend, path)
    assert set(weights) == set(expected) and len(weights) > 0
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert model_id not in backend.calls.models, "closing the session takes its models off the base"


def test_two_users_loops_share_fused_passes_and_see_only_their_own_models(server):
    url, backend, steps = server
    results: dict[str, tuple[str, list[float], str]] = {}
    alone_seeds = {"alice-token": [1, 2, 3], "bob-token": [4, 5, 6]}
    together = threading.Barrier(2)

    def run(key: str) -> None:
        results[key] = sdk_loop(url, key, alone_seeds[key], together=together)

    threads = [threading.Thread(target=run, args=(key,)) for key in alone_seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert set(results) == set(alone_seeds)
    shared = [step for step in steps if step["backward"] and len(step["models"]) == 2]
    assert shared, f"no fused pass held both users' models: {steps}"
    for key, seeds in alone_seeds.items():   # each user's adapter as if trained alone
        expected, expected_losses = engine_reference(seeds)
        assert results[key][1] == expected_losses, key
        weights = saved_weights(backend, results[key][2])
        assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items()), key


def test_another_users_model_is_not_found_and_a_bad_key_is_refused(server):
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    model_id = training.model_id
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                        headers={"X-API-Key": "tml-bob-token"})
    assert answer.status_code == 404 and "no model" in answer.json()["detail"]
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                        headers={"X-API-Key": "tml-mallory"})
    assert answer.status_code == 401
    assert httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                      headers={"X-API-Key": "tml-alice-token"}).json()["lora_rank"] == 4
    client.close("success").result()


def test_forward_backward_custom_trains_as_cross_entropy_does(server):
    url, backend, _ = server
    seeds = [7, 8]
    _, custom, path = sdk_loop(url, "alice-token", seeds, custom=True)
    expected, expected_losses = engine_reference(seeds)
    # the SDK's loss is its own sum of the logprobs it was sent: the same terms, summed in another order
    assert custom == pytest.approx(expected_losses, rel=1e-5)
    weights = saved_weights(backend, path)
    for name, tensor in expected.items():   # its gradients: the weights of a cross_entropy call
        assert torch.allclose(weights[name], tensor, rtol=1e-4, atol=1e-6), name


def test_a_datum_outside_the_vocabulary_fails_that_call_alone(server):
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, VOCAB + 5]),
                      loss_fn_inputs={"target_tokens": np.array([1, 2, 3]), "weights": np.ones(3, np.float32)})
    with pytest.raises(tinker.RequestFailedError, match="outside the base's vocabulary"):
        training.forward_backward([bad], "cross_entropy").result()
    good = training.forward_backward(datums(batch(1)), "cross_entropy").result()   # the model goes on
    assert good.metrics["loss:sum"] > 0
    assert len(good.loss_fn_outputs) == 2 and set(good.loss_fn_outputs[0]) == {"logprobs", "elementwise_loss"}
    client.close("success").result()


if os.environ.get("ASPEN_TINKER_DEBUG"):
    import logging

    logging.basicConfig(level=logging.DEBUG)


def test_sampling_from_saved_weights_through_the_sdk(server):
    from actors.engine.tinker_sampling import SampleCall, sample

    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1, 2))
    saved = training.save_weights_for_sampler("s1").result()
    sampler = client.create_sampling_client(model_path=saved.path)
    prompt = types.ModelInput.from_ints([5, 17, 3, 99])
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                            include_prompt_logprobs=True).result()
    seeded = [sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=5, top_k=30, stop=[])).result()
              for _ in range(2)]
    # the reference: aspen's sampler on the weights saved to disk, attached to a fresh base
    base = from_module(tiny_model("llama", VOCAB), None)
    reference = InteractiveModel(base, "reference", 4, train_unembed=True)   # the SDK's default
    weights = saved_weights(backend, saved.path)
    parameters = dict(reference.adapter.named_parameters())
    with torch.no_grad():
        for name in adapter_state_dict(reference.adapter):
            parameters[name.removeprefix("base_model.model.")].copy_(weights[name])
    (expected,) = sample(base, [SampleCall("reference", (5, 17, 3, 99), max_tokens=6, temperature=0.0,
                                           prompt_logprobs=True)])
    assert greedy.sequences[0].tokens == expected.sequences[0].tokens
    assert greedy.sequences[0].stop_reason == "length" and len(greedy.sequences[0].logprobs) == 6
    assert greedy.prompt_logprobs[0] is None and len(greedy.prompt_logprobs) == 4
    assert [s.tokens for s in seeded[0].sequences] == [s.tokens for s in seeded[1].sequences]
    direct = training.save_weights_and_get_sampling_client("s2")   # the same weights, its own session
    assert direct.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result(
        ).sequences[0].tokens == expected.sequences[0].tokens
    client.close("success").result()


def test_top_k_distillation_through_the_sdk_as_the_cookbooks_sdft_does_it(server):
    """A teacher's top-k prompt log-probabilities (`topk_prompt_logprobs`, the base as teacher) and a student's
    cross_entropy over (N, K) targets weighted by the teacher's renormalised probabilities, through the SDK: the
    teacher's rows are aspen's sampler's on the same base, the student's (N, K) log-probabilities and loss are the
    engine's, and after its optimizer step its weights equal the engine's bit for bit."""
    from actors.engine.tinker_sampling import SampleCall, sample

    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    prompt = [5, 17, 3, 99, 42, 7, 11, 64]
    teacher = client.create_sampling_client(base_model=BASE)
    answer = teacher.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1),
                            include_prompt_logprobs=True, topk_prompt_logprobs=4).result()
    base = from_module(tiny_model("llama", VOCAB), None)
    (expected,) = sample(base, [SampleCall(None, tuple(prompt), max_tokens=1, prompt_logprobs=True, topk_prompt=4)])
    rows = answer.topk_prompt_logprobs
    assert rows[0] is None and len(rows) == len(prompt)
    assert [[token for token, _ in row] for row in rows[1:]] == [ids for ids, _ in expected.topk_prompt[1:]]
    assert [[value for _, value in row] for row in rows[1:]] == [
        np.float32(values).tolist() for _, values in expected.topk_prompt[1:]]

    # the student learns position t's targets (the teacher's top-k for prompt[t + 1]) at input position t
    targets = torch.tensor([[token for token, _ in row] for row in rows[1:]] + [[0] * 4])
    weights = torch.tensor([[value for _, value in row] for row in rows[1:]] + [[-1e9] * 4]).softmax(-1)
    weights[-1] = 0.0
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                        "weights": types.TensorData.from_torch(weights)})
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    result = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    saved = training.save_weights_for_sampler("student").result()
    reference = InteractiveModel(base, adapter_name("reference"), 4, train_unembed=True)   # the SDK's default
    (output,) = run_calls(base, [ModelCall(reference.name, (CallDatum(tuple(prompt), {
        "target_tokens": targets, "weights": weights}),))], backward=True)
    reference.optim_step(AdamStep(**ADAM))
    logprobs = result.loss_fn_outputs[0]["logprobs"]
    assert logprobs.shape == [len(prompt), 4]
    assert torch.equal(logprobs.to_torch(), output.logprobs[0])
    assert result.metrics["loss:sum"] == pytest.approx(output.loss_sum, rel=1e-6)
    written = saved_weights(backend, saved.path)
    for name, value in adapter_state_dict(reference.adapter).items():
        assert torch.equal(written[name], value), name

    # the cookbook's own SDFT step builds its (N, K) datums from aspen's teacher answers, and they train
    sdft = pytest.importorskip("tinker_cookbook.distillation.sdft")
    completion = [21, 8, 30, 2, 77, 19]
    student = prompt[:3] + completion   # the student saw a shorter prompt; the teacher conditions on the whole one
    rollout = types.Datum(model_input=types.ModelInput.from_ints(student[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.tensor(student[1:])),
        "mask": types.TensorData.from_torch(torch.tensor([0.0] * 2 + [1.0] * len(completion)))})
    built, metrics = asyncio.run(sdft.build_topk_distillation_datums(
        [rollout], [{"group_idx": 0}], teacher, [types.ModelInput.from_ints(prompt)], topk=4, skip_first_n_tokens=1))
    targets = built[0].loss_fn_inputs["target_tokens"].to_torch()
    assert targets.shape == (len(student) - 1, 4) and float(built[0].loss_fn_inputs["weights"].to_torch().sum()) > 0
    result = training.forward_backward(built, "cross_entropy").result()
    assert result.loss_fn_outputs[0]["logprobs"].shape == [len(student) - 1, 4] and result.metrics["loss:sum"] > 0
    client.close("success").result()


def test_a_decision_through_the_cookbooks_own_sampler_call_and_alternative_draws(server):
    """tinker-cookbook's `sample_decision` (a classifier: one request scoring each label's token at the answer
    position, `target_prompt_logprobs` sparse) against aspen: its probabilities are the softmax of aspen's sampler's
    log-probabilities of those tokens on the same base; `prompt_alt_tokens_k` with a seed draws, through the SDK, what
    aspen's sampler draws, each with its log-probability."""
    from actors.engine.prompt_scores import TargetCells
    from actors.engine.tinker_sampling import SampleCall, sample

    decision = pytest.importorskip("tinker_cookbook.recipes.decisions.decision")
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    sampler = client.create_sampling_client(base_model=BASE)
    tokens = [5, 17, 3, 99, 42, 7, 0]   # the last is the answer's placeholder
    rendering = decision.DecisionRendering(tokens=tokens, choice_pos=6, label_tokens={"A": 40, "B": 41, "C": 90})
    probabilities = asyncio.run(decision.sample_decision(sampler, rendering))
    base = from_module(tiny_model("llama", VOCAB), None)
    cells = TargetCells((len(tokens) - 1, 3), tuple((5, column, token) for column, token in enumerate((40, 41, 90))))
    (expected,) = sample(base, [SampleCall(None, tuple(tokens), max_tokens=1, target_cells=cells)])
    reference = torch.softmax(torch.tensor(expected.prompt.target[1]).float(), dim=0).tolist()
    assert list(probabilities) == ["A", "B", "C"]
    assert list(probabilities.values()) == pytest.approx(reference, abs=1e-6)

    answer = sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1, seed=4),
                            prompt_alt_tokens_k=3).result()
    (drawn,) = sample(base, [SampleCall(None, tuple(tokens), max_tokens=1, seed=4, alt_k=3)])
    alt = answer.prompt_alt_tokens
    assert alt.tokens.to_torch().tolist() == drawn.prompt.alt[0]
    assert torch.allclose(alt.logprobs.to_torch(), torch.tensor(drawn.prompt.alt[1]), rtol=0, atol=1e-6)
    client.close("success").result()


def test_a_session_that_stops_beating_ends_and_its_models_leave_the_base(server, monkeypatch):
    url, backend, _ = server
    backend.sessions.heartbeat_timeout_s = 0.5
    headers = {"X-API-Key": "tml-alice-token"}
    session = httpx.post(f"{url}/api/v1/create_session", headers=headers,
                         json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    created = httpx.post(f"{url}/api/v1/create_model", headers=headers,
                         json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                               "lora_config": {"rank": 4}}).json()
    model_id = created["model_id"]
    assert model_id in backend.calls.models
    deadline = time.monotonic() + 30
    while model_id in backend.calls.models and time.monotonic() < deadline:
        time.sleep(0.2)
    assert model_id not in backend.calls.models
    answer = httpx.post(f"{url}/api/v1/session_heartbeat", headers=headers,
                        json={"session_id": session, "type": "session_heartbeat"})
    assert answer.status_code == 410   # the SDK stops beating on 410


def test_a_call_over_the_limits_is_refused_saying_so(server, monkeypatch):
    from orchestrator.tinker import tinker_routes

    url, backend, _ = server
    monkeypatch.setattr(tinker_routes, "MAX_CALL_TOKENS", 10)
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.APIStatusError, match="at most 1024 datums and 10 tokens a call"):
        training.forward_backward(datums(batch(1)), "cross_entropy").result()
    assert not backend.calls.models[training.model_id].waiting   # nothing was queued
    client.close("success").result()


def test_a_saved_state_resumes_as_if_never_interrupted(server):
    """Two steps, save_state, two more steps; against two steps, save_state, a new client created from that
    state (weights and AdamW's moments), the same two steps: the same adapter, bit for bit."""
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1, 2))
    state = training.save_state("after-2").result()
    train_steps(training, (3, 4))
    straight = saved_weights(backend, training.save_weights_for_sampler("straight").result().path)
    resumed = client.create_training_client_from_state_with_optimizer(state.path).result()
    train_steps(resumed, (3, 4))
    again = saved_weights(backend, resumed.save_weights_for_sampler("resumed").result().path)
    assert set(again) == set(straight)
    for name, tensor in straight.items():
        assert torch.equal(again[name], tensor), name
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    with pytest.raises(tinker.NotFoundError, match="no saved state"):
        bob.create_training_client_from_state(state.path).result()
    client.close("success").result()
    bob.close("success").result()


def test_train_unembed_as_the_sdk_asks_it(server):
    """The SDK's default (`train_unembed=True`) trains LoRA on the LM head too: its saves hold `lm_head`'s A and B
    (B no longer zero after a step) and say so (weights_info); `train_unembed=False` leaves the head alone; a state
    saved with the head resumes with it; a state without it loaded into a model with it is refused, saying why."""
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    rest = client.create_rest_client()
    with_head = client.create_lora_training_client(base_model=BASE, rank=4).result()
    without = client.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False).result()
    for training in (with_head, without):
        train_steps(training, (1,))
    saved = saved_weights(backend, with_head.save_weights_for_sampler("head").result().path)
    assert saved["base_model.model.lm_head.lora_B.weight"].abs().max() > 0
    assert saved["base_model.model.lm_head.lora_A.weight"].shape == (4, tiny_model("llama", VOCAB).config.hidden_size)
    plain = without.save_weights_for_sampler("plain").result().path
    assert not any("lm_head" in name for name in saved_weights(backend, plain))
    state = with_head.save_state("head-state").result()
    assert rest.get_weights_info_by_tinker_path(state.path).result().train_unembed is True
    assert rest.get_weights_info_by_tinker_path(plain).result().train_unembed is False
    resumed = client.create_training_client_from_state(state.path).result()
    back = saved_weights(backend, resumed.save_weights_for_sampler("resumed").result().path)
    assert torch.equal(back["base_model.model.lm_head.lora_B.weight"], saved["base_model.model.lm_head.lora_B.weight"])
    attention = client.create_lora_training_client(base_model=BASE, rank=4, train_mlp=False).result()
    train_steps(attention, (2,))
    attention_state = attention.save_state("attention-state").result()
    again = client.create_training_client_from_state_with_optimizer(attention_state.path).result()
    kept = saved_weights(backend, again.save_weights_for_sampler("attention-again").result().path)
    first = saved_weights(backend, attention.save_weights_for_sampler("attention").result().path)
    assert set(kept) == set(first) and not any("mlp" in name for name in kept)   # its own layers, no more
    plain_state = without.save_state("plain-state").result()
    with pytest.raises(tinker.RequestFailedError, match="no tensor lm_head.lora_A.weight .*train_unembed=False"):
        with_head.load_state(plain_state.path).result()
    client.close("success").result()


def test_the_rest_client_lists_a_users_runs_and_checkpoints_and_deletes_one(server):
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    training.forward_backward(datums(batch(1)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    state = training.save_state("ck1").result()
    sampler = training.save_weights_for_sampler("s1").result()
    rest = client.create_rest_client()
    run = rest.get_training_run(training.model_id).result()
    assert run.training_run_id == training.model_id and run.lora_rank == 4 and run.base_model == BASE
    assert run.last_checkpoint.tinker_path == state.path
    assert run.last_sampler_checkpoint.tinker_path == sampler.path
    listed = rest.list_checkpoints(training.model_id).result()
    assert sorted(c.checkpoint_id for c in listed.checkpoints) == ["sampler_weights/s1", "weights/ck1"]
    assert all(c.size_bytes > 0 for c in listed.checkpoints)
    assert rest.get_weights_info_by_tinker_path(state.path).result().lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(sampler.path).result()
    listed = rest.list_checkpoints(training.model_id).result()
    assert [c.checkpoint_id for c in listed.checkpoints] == ["weights/ck1"]
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token").create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run(training.model_id).result()
    assert bob.list_user_checkpoints().result().checkpoints == []
    client.close("success").result()


@pytest.mark.parametrize("loss_fn, config", [("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                                             ("gspo", None)])
def test_an_rl_loss_with_its_config_through_the_sdk_is_the_engines(server, loss_fn, config):
    """The loss function, its inputs and its config cross the wire as the SDK writes them (loss_fn_config_v2):
    ppo with its bounds; gspo with its sequence_ratio_mask (the sampled tokens, as the cookbook's rl_loop marks them)
    and its defaults."""
    url, backend, _ = server
    generator = np.random.default_rng(3)
    rows = []
    for _ in range(2):
        length = int(generator.integers(5, 15))
        tokens, targets = generator.integers(0, VOCAB, length).tolist(), generator.integers(0, VOCAB, length).tolist()
        inputs = {"logprobs": (-generator.random(length) * 5).astype(np.float32),
                  "advantages": generator.normal(size=length).astype(np.float32)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (np.arange(length) >= 2).astype(np.float32)   # after a 2-token prompt
        rows.append((tokens, targets, inputs))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64), **inputs})
            for tokens, targets, inputs in rows]
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    result = training.forward_backward(data, loss_fn, loss_fn_config=config).result()
    base = from_module(tiny_model("llama", VOCAB), None)
    InteractiveModel(base, "reference", 4, train_unembed=True)   # the SDK's default
    call = ModelCall("reference", tuple(CallDatum(tuple(tokens), {"target_tokens": torch.tensor(targets), **{
        name: torch.from_numpy(value) for name, value in inputs.items()}}) for tokens, targets, inputs in rows),
        loss_fn, config)
    (expected,) = run_calls(base, [call], backward=True)
    assert result.metrics["loss:sum"] == expected.loss_sum
    for output, logprobs in zip(result.loss_fn_outputs, expected.logprobs, strict=True):
        assert np.array_equal(output["logprobs"].to_numpy(), logprobs.numpy())
    client.close("success").result()


def test_the_sdks_get_tokenizer_loads_the_bases_own(tmp_path, monkeypatch, tiny_model_dirs):
    """The SDK's `get_tokenizer()` loads what get_info names (`tokenizer_id`): for a base read from a folder, that
    folder, so that it works with no hub at hand and tokenizes as the base does; the embedded base names its hub id;
    a base with neither (built in memory, a GGUF file of one's own) names none."""
    from actors.engine.models import load_base_model
    from actors.storage.base_identity import tokenizer_id
    from actors.storage.sources import ALIAS_HUB_IDS, ModelSource, resolve_source

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    with tinker_in_process(base, BASE, tmp_path / "weights", KEYS.get, window_s=WINDOW_S) as (url, _, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        tokenizer = training.get_tokenizer()
        text = "Question: what is 12 + 30?\nAnswer: 42"
        assert tokenizer.encode(text) == base.tokenizer.encode(text)
        client.close("success").result()
    assert tokenizer_id("smollm2-135m", resolve_source("smollm2-135m")) == ALIAS_HUB_IDS["smollm2-135m"]
    assert tokenizer_id("in-memory", ModelSource("in-memory", None, True)) is None
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    assert tokenizer_id(str(own), ModelSource(str(tmp_path), "mine.gguf", True)) is None


def test_a_client_on_the_servers_machine_loads_the_embedded_bases_tokenizer_with_no_hub(tmp_path, monkeypatch):
    """The embedded smollm2-135m (a GGUF file) and the SDK's `get_tokenizer()` on the server's machine, with the hub
    out of reach (HF_HUB_OFFLINE, an empty HF cache): get_info names the folder its tokenizer is read from here (the
    converted GGUF folder), which tokenizes as the trainer's own tokenizer does; a client elsewhere (not a loopback
    address) is told the hub id, which a machine with the hub or its cache loads."""
    from starlette.requests import Request

    from actors.engine.models import load_base_model
    from actors.storage.sources import ALIAS_HUB_IDS
    from orchestrator.tinker.tinker_routes import tokenizer_for

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    base = load_base_model("smollm2-135m", dtype="float32", device="cpu")
    served = tinker_in_process(base, "smollm2-135m", tmp_path / "weights", KEYS.get, window_s=WINDOW_S)
    with served as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model="smollm2-135m", rank=4).result()
        tokenizer = training.get_tokenizer()
        for text in ("Question: what is 12 + 30?\nAnswer: 42", "<|im_start|>user\nHola, ¿qué tal?<|im_end|>\n"):
            assert tokenizer.encode(text, add_special_tokens=False) == base.tokenizer.encode(text,
                                                                                          add_special_tokens=False)
        client.close("success").result()
        facts = backend.facts("smollm2-135m")
    elsewhere = Request({"type": "http", "client": ("10.0.0.7", 51000), "headers": []})
    assert tokenizer_for(facts, elsewhere) == ALIAS_HUB_IDS["smollm2-135m"]
    here = Request({"type": "http", "client": ("127.0.0.1", 51000), "headers": []})
    assert tokenizer_for(facts, here) == facts["tokenizer_folder"]
    proxied = Request({"type": "http", "client": ("127.0.0.1", 51000),
                       "headers": [(b"x-forwarded-for", b"203.0.113.9")]})   # a reverse proxy on this machine
    assert tokenizer_for(facts, proxied) == ALIAS_HUB_IDS["smollm2-135m"]
    assert tokenizer_for({**facts, "tokenizer_folder": str(tmp_path / "not-on-this-machine")}, here) == \
        ALIAS_HUB_IDS["smollm2-135m"]   # a trainer on another node: its folder is not here


def test_a_checkpoints_time_to_live_and_metadata_are_kept_and_it_is_deleted_when_it_expires(server, clock):
    """save_state and save_weights_for_sampler with `ttl_seconds` and `user_metadata` through the SDK: the RestClient
    lists them with their expiry and metadata; a time to live outside the SDK's range is refused, naming it; once the
    clock passes a checkpoint's expiry its files are deleted, it is no longer listed, and loading or sampling it
    says when it expired; a restarted server's ledger still knows. A checkpoint saved without one stays."""
    from orchestrator.tinker import checkpoint_ledger

    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    hour = training.save_state("hour", ttl_seconds=3600, user_metadata={"note": "first"}).result()
    kept = training.save_state("kept").result()
    sampler = training.save_weights_for_sampler("two-hours", ttl_seconds=7200).result()
    with pytest.raises(tinker.APIStatusError, match=r"ttl_seconds is 60: .* between 3600 \(1 hour\) and"):
        training.save_state("brief", ttl_seconds=60).result()
    rest = client.create_rest_client()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert set(listed) == {hour.path, kept.path, sampler.path}
    assert abs(listed[hour.path].expires_at.timestamp() - (clock[0] + 3600)) < 1
    assert listed[hour.path].user_metadata == {"note": "first"}
    assert listed[kept.path].expires_at is None and listed[kept.path].user_metadata is None
    sampling = client.create_sampling_client(model_path=sampler.path)   # a session on it, before it expires

    clock[0] += 3601
    listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {kept.path, sampler.path}
    assert not (backend.folder(training.model_id) / "weights" / "hour").exists()
    with pytest.raises(tinker.NotFoundError, match=r"expired at .* \(the ttl_seconds it was saved with\)"):
        client.create_training_client_from_state(hour.path).result()

    clock[0] += 3600
    backend.sweep_expired()
    assert sampler.path not in backend.book.samplers   # its frozen copy left the base
    assert not (backend.folder(training.model_id) / "sampler_weights" / "two-hours").exists()
    with pytest.raises(tinker.NotFoundError, match="expired at"):
        client.create_sampling_client(model_path=sampler.path).sample(
            types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    del sampling
    ledger = checkpoint_ledger.CheckpointLedger(backend.weights_dir)   # as a restarted server reads it
    assert ledger.expired_note(hour.path) is not None and ledger.due() == []
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [kept.path]
    client.close("success").result()


def adapters_on(backend: TinkerBackend) -> set[str]:
    """The adapters attached to the served base now."""
    from actors.engine.adapter_surgery import fused_layers

    return {name for layer in fused_layers(backend.calls.base.model) for name in layer.adapters}


def greedy(sampler, prompt: list[int]):
    return sampler.sample(types.ModelInput.from_ints(prompt), 1,
                          types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                          include_prompt_logprobs=True).result()


def same_samples(result, reference) -> None:
    """The same greedy sequence, its log-probabilities and the prompt's, bit for bit."""
    assert result.sequences[0].tokens == reference.sequences[0].tokens
    assert result.sequences[0].logprobs == reference.sequences[0].logprobs
    assert result.prompt_logprobs == reference.prompt_logprobs


def test_sampler_weights_are_sampled_after_their_model_ended_and_on_a_restarted_server(server, tmp_path):
    """A tinker:// sampler path outlives its model, as Tinker's do: once the model's session has closed, a sampling
    session of another session of the same user (one opened before the close, and one after), and one on a
    restarted server over the same weights folder, sample the files read back onto the base, giving what the
    model's own frozen copy gave (greedy tokens and every log-probability, bit for bit); the read-back copy leaves
    the base when its last sampling session ends. Files that cannot serve fail that session alone, naming the file."""
    url, backend, _ = server
    prompt = [5, 17, 3, 99]
    trainer = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = trainer.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1, 2))
    saved = training.save_weights_for_sampler("s1").result()
    live = greedy(trainer.create_sampling_client(model_path=saved.path), prompt)
    reader = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    early = reader.create_sampling_client(model_path=saved.path)   # on the model's frozen copy, while it lives
    same_samples(greedy(early, prompt), live)
    trainer.close("success").result()

    def same(result) -> None:
        same_samples(result, live)

    same(greedy(early, prompt))   # its model ended since the session began: read back now
    (held,) = backend.held.held.values()
    assert held.adapter in adapters_on(backend)
    same(greedy(reader.create_sampling_client(model_path=saved.path), prompt))
    reader.close("success").result()
    deadline = time.monotonic() + 30
    while held.adapter in adapters_on(backend) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.adapter not in adapters_on(backend) and not backend.held.held

    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, backend.weights_dir, KEYS.get,
                           window_s=WINDOW_S) as (again_url, _, _):
        restarted = tinker.ServiceClient(base_url=again_url, api_key="tml-alice-token")
        same(greedy(restarted.create_sampling_client(model_path=saved.path), prompt))
        restarted.close("success").result()

    weights = backend.weights_dir / training.model_id.replace(":", "-") / "sampler_weights" / "s1"
    (weights / "adapter_model.safetensors").write_bytes(b"not safetensors")
    other = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    with pytest.raises(tinker.APIStatusError, match=r"adapter_model.safetensors is not a safetensors file"):
        greedy(other.create_sampling_client(model_path=saved.path), prompt)
    assert other.create_sampling_client(base_model=BASE).sample(   # the session goes on
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)).result().sequences
    other.close("success").result()


def test_a_published_checkpoint_is_loaded_and_sampled_by_another_user_and_its_ttl_is_set(server, clock):
    """The RestClient's publish / unpublish and set_checkpoint_ttl through the SDK: another user gets 404 for an
    unpublished checkpoint; once published, they read its weights info, sample its sampler weights (what its owner
    samples) and create a training client from its state (its weights), but cannot list, publish or delete it;
    publishing twice or unpublishing a private one is 409; after unpublishing, it is 404 to them again. A time to
    live set later is listed and deletes the checkpoint when it passes; None removes it; one out of range is 400."""
    url, backend, _ = server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("shared").result()
    sampler = training.save_weights_for_sampler("shared").result()
    prompt = [5, 17, 3, 99]
    owners = greedy(alice.create_sampling_client(model_path=sampler.path), prompt)
    rest = alice.create_rest_client()
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob_rest = bob.create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        greedy(bob.create_sampling_client(model_path=sampler.path), prompt)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state.path).result()

    for path in (state.path, sampler.path):
        rest.publish_checkpoint_from_tinker_path(path).result()
    # 409 as Tinker documents it; asked directly, since the SDK retries a 409 for five minutes before raising it
    publish_url = f"{url}/api/v1/training_runs/{training.model_id}/checkpoints/weights/shared/publish"
    again = httpx.post(publish_url, headers={"X-API-Key": "tml-alice-token"})
    assert again.status_code == 409 and "public already" in again.json()["detail"]
    with pytest.raises(tinker.NotFoundError):
        bob_rest.publish_checkpoint_from_tinker_path(state.path).result()
    listed = {c.tinker_path: c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {state.path: True, sampler.path: True}
    assert bob_rest.get_weights_info_by_tinker_path(state.path).result().lora_rank == 4
    same_samples(greedy(bob.create_sampling_client(model_path=sampler.path), prompt), owners)
    loaded = bob.create_training_client_from_state(state.path).result()
    mine = saved_weights(backend, loaded.save_weights_for_sampler("copy").result().path)
    theirs = saved_weights(backend, sampler.path)
    assert set(mine) == set(theirs) and all(torch.equal(mine[name], theirs[name]) for name in theirs)
    assert bob_rest.list_user_checkpoints().result().checkpoints[0].tinker_path.startswith(f"tinker://{loaded.model_id}")
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(state.path).result()

    rest.unpublish_checkpoint_from_tinker_path(state.path).result()
    again = httpx.delete(publish_url, headers={"X-API-Key": "tml-alice-token"})
    assert again.status_code == 409 and "private already" in again.json()["detail"]
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(state.path).result()

    rest.set_checkpoint_ttl_from_tinker_path(state.path, 7200).result()
    checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
    (listed,) = [c for c in checkpoints if c.tinker_path == state.path]
    assert abs(listed.expires_at.timestamp() - (clock[0] + 7200)) < 1
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds is 5: .* between 3600"):
        rest.set_checkpoint_ttl_from_tinker_path(state.path, 5).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler.path, 3600).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler.path, None).result()
    clock[0] += 7201
    listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {sampler.path}   # the state expired; the sampler's time to live was removed
    alice.close("success").result()
    bob.close("success").result()


def test_a_front_deletes_expired_checkpoints_without_waiting_for_a_request(tmp_path, monkeypatch, caplog, clock):
    """A front whose weights folder is asked of its service (as `aspen http`'s is), started after a checkpoint's
    time to live passed: its reaper finds the folder by itself and deletes the checkpoint, no request needed; while
    the service does not answer, it says so and tries again."""
    from orchestrator.tinker import tinker_backend
    from orchestrator.tinker.rest_routes import saved_checkpoints

    monkeypatch.setattr(tinker_backend, "REAP_EVERY_S", 0.02)
    monkeypatch.setattr(tinker_backend, "FIND_FOLDER_EVERY_S", 0.1)
    weights = tmp_path / "weights"
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, weights, KEYS.get,
                           window_s=WINDOW_S) as (url, _, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        state = training.save_state("brief", ttl_seconds=3600).result()
        kept = training.save_state("kept").result()
        client.close("success").result()
    clock[0] += 3601
    answers = iter([RuntimeError("the service did not answer")])

    def folder() -> Path:   # the service's answer; its first try fails
        failure = next(answers, None)
        if failure is not None:
            raise failure
        return weights

    backend = TinkerBackend(InteractiveCalls(from_module(tiny_model("llama", VOCAB), None)), BASE, folder,
                            KEYS.get)
    with caplog.at_level("WARNING", logger="orchestrator.tinker.tinker_backend"):
        backend.start()
        try:
            deadline = time.monotonic() + 30
            while len(list(saved_checkpoints(weights))) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            backend.close()
    left = [f"tinker://{facts['model_id']}/{kind}/{name}" for facts, _, kind, name in saved_checkpoints(weights)]
    assert left == [kept.path] and state.path != kept.path
    assert "the weights folder is not known yet (the service did not answer)" in caplog.text


def test_the_rest_client_pages_a_users_runs_and_lists_their_sessions(server):
    """list_training_runs through the SDK: the user's runs, the most recent first, a page at a time with the total;
    with access_scope="accessible" also another user's run that has a published checkpoint (that one alone);
    list_sessions and get_session: the user's sessions (live and ended), each one's runs, samplers, metadata and
    name; another user's session is 404, and a project_id (aspen has none) is refused, saying so."""
    url, _, _ = server
    alice = tinker.ServiceClient(user_metadata={"team": "a"}, display_name="first", base_url=url,
                                 api_key="tml-alice-token")
    runs = [alice.create_lora_training_client(base_model=BASE, rank=4).result() for _ in range(3)]
    for index, run in enumerate(runs):   # each run's checkpoint later than the one before
        run.save_state(f"state-{index}").result()
        time.sleep(0.02)
    sampler_path = runs[0].save_weights_for_sampler("s").result().path
    sampling = alice.create_sampling_client(model_path=sampler_path)
    greedy(sampling, [5, 17])
    rest = alice.create_rest_client()
    first = rest.list_training_runs(limit=2).result()
    assert first.cursor.total_count == 3 and first.cursor.limit == 2
    rest_of = rest.list_training_runs(limit=2, offset=2).result()
    listed = [r.training_run_id for r in first.training_runs + rest_of.training_runs]
    assert listed == [runs[0].model_id, runs[2].model_id, runs[1].model_id]   # run 0's sampler save is the latest
    assert all(r.model_owner == "alice" and r.lora_rank == 4 for r in first.training_runs)
    with pytest.raises(tinker.UnprocessableEntityError, match="aspen has no projects"):
        rest.list_training_runs(project_id="p").result()

    session_id = runs[0].model_id.split(":train:")[0]
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob_rest = bob.create_rest_client()
    bob_run = bob.create_lora_training_client(base_model=BASE, rank=2).result()
    published = bob_run.save_state("shared").result()
    bob_run.save_state("private").result()
    bob_rest.publish_checkpoint_from_tinker_path(published.path).result()
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == listed
    everyone = rest.list_training_runs(access_scope="accessible").result().training_runs
    accessible = {r.training_run_id: r for r in everyone}
    assert set(accessible) == {*listed, bob_run.model_id}
    assert accessible[bob_run.model_id].model_owner == "bob"
    assert accessible[bob_run.model_id].last_checkpoint.tinker_path == published.path

    info = rest.get_session(session_id).result()
    assert info.training_run_ids == [run.model_id for run in runs] and len(info.sampler_ids) == 1
    assert info.user_metadata == {"team": "a"} and info.display_name == "first"
    assert rest.list_sessions().result().sessions == [session_id]
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_session(session_id).result()
    alice.close("success").result()
    again = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    again.create_lora_training_client(base_model=BASE, rank=4).result()
    again_rest = again.create_rest_client()
    sessions = again_rest.list_sessions().result().sessions
    assert len(sessions) == 2 and sessions[1] == session_id   # the newest first; the ended one still listed
    assert again_rest.get_session(session_id).result().training_run_ids == [run.model_id for run in runs]
    again.close("success").result()
    bob.close("success").result()


def test_external_weights_are_the_merged_model_downloaded_through_signed_urls(tmp_path, monkeypatch, tiny_model_dirs):
    """save_weights_external and get_external_weights_urls through the SDK, on a base read from a folder: the files
    the signed URLs download (no key) load with transformers' from_pretrained and give PEFT's logits of the same
    adapter (its sampler weights) on the base, within float32's rounding of a merge; the checkpoint is listed as
    "external"; another user gets 404, a changed or expired URL 403 (a URL signs its own file only), and age
    encryption is refused (422), naming it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.engine.models import load_base_model
    from orchestrator.tinker import external_weights

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    with tinker_in_process(base, BASE, tmp_path / "weights", KEYS.get, window_s=WINDOW_S) as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        train_steps(training, (1, 2))
        sampler = training.save_weights_for_sampler("s").result()
        external = training.save_weights_external("hf").result()
        assert external.path == f"tinker://{training.model_id}/external_weights/hf"
        rest = client.create_rest_client()
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        kinds = {c.tinker_path: c.checkpoint_type for c in listed}
        assert kinds == {sampler.path: "sampler", external.path: "external"}
        urls = rest.get_external_weights_urls(external.path).result().urls
        assert {"config.json", "model.safetensors"} <= set(urls) and "aspen.json" not in urls
        downloaded = tmp_path / "downloaded"
        downloaded.mkdir()
        for name, link in urls.items():
            answer = httpx.get(link)
            assert answer.status_code == 200, (name, answer.text)
            (downloaded / name).write_bytes(answer.content)
        tampered = httpx.get(urls["config.json"].replace("signature=", "signature=0"))
        assert tampered.status_code == 403 and "not one aspen signed" in tampered.json()["detail"]
        other = httpx.get(urls["config.json"].replace("config.json", "model.safetensors"))
        assert other.status_code == 403   # a URL signs its own file only
        monkeypatch.setattr(external_weights, "URLS_VALID_S", -1)
        stale = httpx.get(rest.get_external_weights_urls(external.path).result().urls["config.json"])
        assert stale.status_code == 403 and "expired" in stale.json()["detail"]
        bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
        with pytest.raises(tinker.NotFoundError):
            bob.create_rest_client().get_external_weights_urls(external.path).result()
        with pytest.raises(tinker.APIStatusError, match="age_encryption_recipients"):
            training.save_weights_external("sealed", age_encryption_recipients=["age1abc"]).result()
        client.close("success").result()
        bob.close("success").result()
        folder = backend.weights_dir / training.model_id.replace(":", "-") / "sampler_weights" / "s"

    merged = AutoModelForCausalLM.from_pretrained(downloaded, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32), folder).eval()
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7]])
    with torch.no_grad():
        got, expected = merged(tokens).logits, reference(tokens).logits
        bare = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)(tokens).logits
    # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a relative error of a few float32
    # epsilons (1.2e-7) per layer, far below the adapter's own effect on the logits
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    assert float((expected - bare).abs().max()) > 1e-3 * scale


def test_a_base_that_cannot_be_merged_fails_that_external_save_alone(server):
    """A base built in memory has no files to merge into: save_weights_external fails, saying why (the base cannot
    be loaded), leaves nothing behind, and the model trains on."""
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match=r"external_weights/hf: merging the adapter into its base"):
        training.save_weights_external("hf").result()
    train_steps(training, (1,))   # the model goes on
    assert not list((server[1].folder(training.model_id) / "external_weights").glob("*"))
    client.close("success").result()


def engine_greedy(weights: dict[str, torch.Tensor], prompt: list[int]) -> list[int]:
    """aspen's sampler, greedy, through these saved weights (PEFT's names) attached to a fresh copy of the base."""
    from actors.engine.tinker_sampling import SampleCall, sample

    base = from_module(tiny_model("llama", VOCAB), None)
    reference = InteractiveModel(base, "reference", 4, train_unembed=True)   # the SDK's default
    parameters = dict(reference.adapter.named_parameters())
    with torch.no_grad():
        for name in adapter_state_dict(reference.adapter):
            parameters[name.removeprefix("base_model.model.")].copy_(weights[name])
    (result,) = sample(base, [SampleCall("reference", tuple(prompt), max_tokens=6, temperature=0.0)])
    return result.sequences[0].tokens


def test_a_sampler_path_saved_again_samples_the_new_weights(server):
    """save_weights_for_sampler under a name saved before (after more training): its sampling sessions, the one
    opened before and a new one, sample the new weights, as the files now hold them."""
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    prompt = [5, 17, 3, 99]
    train_steps(training, (1,))
    first = training.save_weights_for_sampler("s").result()
    before = client.create_sampling_client(model_path=first.path)
    old = greedy(before, prompt)
    assert old.sequences[0].tokens == engine_greedy(saved_weights(backend, first.path), prompt)
    train_steps(training, (2, 3))
    again = training.save_weights_for_sampler("s").result()
    expected = engine_greedy(saved_weights(backend, again.path), prompt)
    new = greedy(client.create_sampling_client(model_path=again.path), prompt)
    assert new.sequences[0].tokens == expected and new.prompt_logprobs != old.prompt_logprobs
    same_samples(greedy(before, prompt), new)
    client.close("success").result()


def test_ephemeral_sampling_clients_write_no_files_and_a_model_keeps_its_newest(server, monkeypatch):
    """save_weights_and_get_sampling_client, as an RL loop calls it every step: no files are written (Tinker's are
    ephemeral), each client samples the weights of its moment (greedy: as a named save at the same moment), and
    the base holds the copies of the model's newest MAX_EPHEMERAL only: an older client's sample is refused,
    saying why and what to do."""
    from actors.engine.adapter_surgery import fused_layers
    from orchestrator.tinker import tinker_backend

    monkeypatch.setattr(tinker_backend, "MAX_EPHEMERAL", 2)
    url, backend, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    prompt = [5, 17, 3, 99]
    clients, named = [], []
    for seed in (1, 2, 3):
        train_steps(training, (seed,))
        clients.append(training.save_weights_and_get_sampling_client().result())
        at_once = training.save_weights_for_sampler(f"n{seed}").result()
        named.append(engine_greedy(saved_weights(backend, at_once.path), prompt))
    folder = backend.folder(training.model_id) / "sampler_weights"
    assert sorted(path.name for path in folder.iterdir()) == ["n1", "n2", "n3"]
    for sampler, expected in zip(clients[1:], named[1:], strict=True):
        assert greedy(sampler, prompt).sequences[0].tokens == expected
    with pytest.raises(tinker.NotFoundError, match=r"no longer on the base: a model keeps the copies of its 2 newest"):
        greedy(clients[0], prompt)
    deadline = time.monotonic() + 10

    def ephemeral_copies() -> set[str]:
        return {name for layer in fused_layers(backend.calls.base.model) for name in layer.adapters
                if "ephemeral" in name}

    while len(ephemeral_copies()) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ephemeral_copies()) == 2
    client.close("success").result()
