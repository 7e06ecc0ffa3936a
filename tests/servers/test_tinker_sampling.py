"""The Tinker API's sampling, driven by the real `tinker` SDK: sampling from saved weights gives what aspen's sampler
gives on the same weights (greedy: the same tokens; a seed: the same samples again), top-k logprobs as the cookbook's
distillation asks them, the cookbook's own sampler calls; a sampler path outlives its model and a restarted server,
is sampled anew once saved again; ephemeral sampling clients write no files; sampling a deleted checkpoint says
so."""


from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import adapter_name
from orchestrator.tinker.tinker_routes import TinkerBackend
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import (  # noqa: E402
    ADAM,
    BASE,
    KEYS,
    WINDOW_S,
    greedy,
    same_samples,
    saved_weights,
    train_steps,
)


def test_sampling_from_saved_weights_through_the_sdk(sdk_server):
    from actors.engine.tinker_sampling import SampleCall, sample

    url, backend, _ = sdk_server
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
    # max_tokens 0 is refused at once, as 4097 is (it was taken as the default 256, a minute's sampling on a CPU)
    for tokens in (0, 4097):
        with pytest.raises(tinker.APIStatusError, match="max_tokens must be 1..4096"):
            direct.sample(prompt, 1, types.SamplingParams(max_tokens=tokens)).result()
    client.close("success").result()


def test_top_k_distillation_through_the_sdk_as_the_cookbooks_sdft_does_it(sdk_server):
    """A teacher's top-k prompt log-probabilities (`topk_prompt_logprobs`, the base as teacher) and a student's
    cross_entropy over (N, K) targets weighted by the teacher's renormalised probabilities, through the SDK: the
    teacher's rows are aspen's sampler's on the same base, the student's (N, K) log-probabilities and loss are the
    engine's, and after its optimizer step its weights equal the engine's bit for bit."""
    from actors.engine.tinker_sampling import SampleCall, sample

    url, backend, _ = sdk_server
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
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
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


def test_a_decision_through_the_cookbooks_own_sampler_call_and_alternative_draws(sdk_server):
    """tinker-cookbook's `sample_decision` (a classifier: one request scoring each label's token at the answer
    position, `target_prompt_logprobs` sparse) against aspen: its probabilities are the softmax of aspen's sampler's
    log-probabilities of those tokens on the same base; `prompt_alt_tokens_k` with a seed draws, through the SDK, what
    aspen's sampler draws, each with its log-probability."""
    from actors.engine.prompt_scores import TargetCells
    from actors.engine.tinker_sampling import SampleCall, sample

    decision = pytest.importorskip("tinker_cookbook.recipes.decisions.decision")
    url, backend, _ = sdk_server
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


def adapters_on(backend: TinkerBackend) -> set[str]:
    """The adapters attached to the served base now."""
    from actors.engine.adapter_surgery import fused_layers

    return {name for layer in fused_layers(backend.calls.base.model) for name in layer.adapters}






def test_sampler_weights_are_sampled_after_their_model_ended_and_on_a_restarted_server(sdk_server, tmp_path):
    """A tinker:// sampler path outlives its model, as Tinker's do: once the model's session has closed, a sampling
    session of another session of the same user (one opened before the close, and one after), and one on a
    restarted server over the same weights folder, sample the files read back onto the base, giving what the
    model's own frozen copy gave (greedy tokens and every log-probability, bit for bit); the read-back copy leaves
    the base when its last sampling session ends. Files that cannot serve fail that session alone, naming the file."""
    url, backend, _ = sdk_server
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


def test_a_sampler_path_saved_again_samples_the_new_weights(sdk_server):
    """save_weights_for_sampler under a name saved before (after more training): its sampling sessions, the one
    opened before and a new one, sample the new weights, as the files now hold them."""
    url, backend, _ = sdk_server
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


def test_ephemeral_sampling_clients_write_no_files_and_a_model_keeps_its_newest(sdk_server, monkeypatch):
    """save_weights_and_get_sampling_client, as an RL loop calls it every step: no files are written (Tinker's are
    ephemeral), each client samples the weights of its moment (greedy: as a named save at the same moment), and
    the base holds the copies of the model's newest MAX_EPHEMERAL only: an older client's sample is refused,
    saying why and what to do."""
    from actors.engine.adapter_surgery import fused_layers
    from orchestrator.tinker import tinker_backend

    monkeypatch.setattr(tinker_backend, "MAX_EPHEMERAL", 2)
    url, backend, _ = sdk_server
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


def hf_greedy(prompt: list[int], count: int) -> tuple[list[int], list[float], list[float]]:
    """The independent reference: transformers' own forward of the tiny base (the server's weights: the same seed)
    over the whole sequence at each step, no cache: `count` greedy tokens, their log-probabilities, and the prompt's
    (token t's under the logits at t - 1)."""
    model = tiny_model("llama", VOCAB)
    sequence, sampled = list(prompt), []
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        prompt_logprobs = first[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        for _ in range(count):
            last = model(torch.tensor([sequence])).logits[0, -1].float().log_softmax(-1)
            token = int(last.argmax())
            sequence.append(token)
            sampled.append(float(last[token]))
    return sequence[len(prompt):], sampled, prompt_logprobs


def test_a_sample_to_the_last_position_of_the_bases_context_is_answered_one_past_it_refused(sdk_server):
    """k tokens sampled after a prompt of n feed the base n + k - 1 positions (the last sampled token is never fed):
    a prompt of the whole context (get_server_capabilities' max_context_length) is scored by compute_logprobs (the
    SDK's one sampled token with prompt logprobs: it was refused) and samples one token, and a shorter one samples
    up to the context's last position; the answers are transformers' own forward of the same base. One position
    more fails that sample with category user, naming the lengths and how many tokens it may ask for."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    (model,) = client.get_server_capabilities().supported_models
    context = model.max_context_length
    sampler = client.create_sampling_client(base_model=BASE).result()
    prompt = np.random.default_rng(7).integers(3, VOCAB, context).tolist()

    def greedy_of(tokens: list[int], count: int):
        params = types.SamplingParams(max_tokens=count, temperature=0.0, stop=[])
        return sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result(timeout=120)

    tokens, sampled, prompt_logprobs = hf_greedy(prompt, 1)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=120)
    assert len(scored) == context and scored[0] is None
    assert scored[1:] == pytest.approx(prompt_logprobs, abs=1e-4)
    (sequence,) = greedy_of(prompt, 1).sequences
    assert sequence.tokens == tokens and sequence.logprobs == pytest.approx(sampled, abs=1e-4)
    shorter = prompt[:context - 4]
    tokens, sampled, _ = hf_greedy(shorter, 5)
    (sequence,) = greedy_of(shorter, 5).sequences
    assert sequence.tokens == tokens and sequence.logprobs == pytest.approx(sampled, abs=1e-4)

    with pytest.raises(tinker.RequestFailedError, match=f"the prompt has {context} tokens and max_tokens is 2: "
                       f"{context + 1} positions fed.*ask for at most 1 token\\b"):
        greedy_of(prompt, 2)
    with pytest.raises(tinker.RequestFailedError, match="ask for at most 5 tokens"):
        greedy_of(shorter, 6)
    with pytest.raises(tinker.RequestFailedError, match=f"the prompt has {context + 1} tokens"):
        sampler.compute_logprobs(types.ModelInput.from_ints(prompt + [5])).result(timeout=60)
    client.close("success").result()


def test_a_sample_without_max_tokens_stops_at_the_bases_context(sdk_server):
    """SamplingParams without max_tokens sample 256 tokens, or as many as the base's context has room for after the
    prompt (a prompt 10 short of it: 11, to its last position; they were refused, saying max_tokens was 256, which
    the user never asked for): transformers' own greedy tokens. A prompt past the context is still refused."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    context = client.create_rest_client().get_server_capabilities().result().supported_models[0].max_context_length
    sampler = client.create_sampling_client(base_model=BASE).result()
    prompt = np.random.default_rng(8).integers(3, VOCAB, context).tolist()
    unbounded = types.SamplingParams(temperature=0.0, stop=[])

    def tokens_of(prompt: list[int]) -> list[int]:
        return sampler.sample(types.ModelInput.from_ints(prompt), 1, unbounded).result(timeout=120).sequences[0].tokens

    near = prompt[:context - 10]
    assert tokens_of(near) == hf_greedy(near, 11)[0]
    assert len(tokens_of(prompt[:20])) == 256
    assert len(tokens_of(prompt)) == 1
    with pytest.raises(tinker.RequestFailedError, match=f"the prompt has {context + 1} tokens; the base's context"):
        tokens_of(prompt + [5])
    client.close("success").result()


def test_sampling_or_loading_a_deleted_checkpoint_says_it_was_deleted(sdk_server):
    """A sampling client opened on sampler weights that are then deleted (RestClient.delete_checkpoint_from_tinker_path)
    is told, at its next sample, that its checkpoint was deleted and what to do (it was told "no sampling session ...
    of yours"); so is a new client on that path, a load of a deleted state, and a server restarted since (the ledger's
    mark). Saved again under that path, it samples again."""
    from orchestrator.tinker.checkpoint_ledger import CheckpointLedger

    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    sampler = training.save_weights_for_sampler("gone").result()
    state = training.save_state("gone").result()
    sampling = client.create_sampling_client(model_path=sampler.path)
    greedy(sampling, [5, 17, 3])
    rest = client.create_rest_client()
    for path in (sampler.path, state.path):
        rest.delete_checkpoint_from_tinker_path(path).result()
    deleted = (rf"{sampler.path} was deleted by its owner \(delete_checkpoint\) at .*; "
               "save_weights_for_sampler again, or open a sampling client on another checkpoint")
    with pytest.raises(tinker.NotFoundError, match=deleted):
        greedy(sampling, [5, 17, 3])
    with pytest.raises(tinker.NotFoundError, match=deleted):
        greedy(client.create_sampling_client(model_path=sampler.path), [5, 17, 3])
    with pytest.raises(tinker.NotFoundError, match=rf"{state.path} was deleted by its owner .*; save_state again"):
        training.load_state(state.path).result()
    assert "was deleted by its owner" in (CheckpointLedger(backend.weights_dir).gone_note(sampler.path, "alice") or "")
    training.save_weights_for_sampler("gone").result()
    greedy(client.create_sampling_client(model_path=sampler.path), [5, 17, 3])
    client.close("success").result()
