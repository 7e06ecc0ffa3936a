"""tinker-cookbook's own recipes, their code unchanged, against aspen's Tinker API as `aspen http` serves it over
a running service (a real local Ray, a trainer holding the embedded smollm2-135m; each recipe's model a job of
its user): the basic supervised recipe (recipes/sl_basic.py, on a conversations file this test writes) lowers
its training loss, and its first step's loss is the base's own, as transformers computes it; the math RL recipe
(recipes/math_rl/train.py, its arithmetic environment: a verifiable reward, no data to download) runs end to end
and raises its reward. What they need here: the cookbook's tokenizer registry given the base's tokenizer (built
from the GGUF file), the `qwen3_instruct` renderer (SmolLM2's ChatML chat template, checked below against the
tokenizer's own), and no network: a connection anywhere but this machine fails the test."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker", reason="the tinker SDK (the `tinker` extra) is not installed")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (the `cookbook` extra, then "
                                              "`pip install --no-deps tinker-cookbook==0.6.1`: see docs/tinker.md)")
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.recipes import sl_basic
from tinker_cookbook.recipes.math_rl import train as math_rl
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.utils import cost_estimation

from actors.engine.models import load_base_model, resolve_source
from actors.service.accounts.users import UserBook
from actors.storage.gguf_cache import converted_source
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.service_calls import ServiceLink
from tests.helpers.http_server import running_server
from tests.helpers.service import service_config

# the real smollm2-135m, trained and sampled for a few steps; the recipes' SDK clients closed (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("closes_tinker_clients")]

BASE = "smollm2-135m"
RENDERER = "qwen3_instruct"     # ChatML: <|im_start|>role\n...<|im_end|>, SmolLM2's chat template
SYSTEM = {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Blue is a primary color."}],
    [{"role": "user", "content": "What is 15 + 27?"}, {"role": "assistant", "content": "15 + 27 = 42"}],
    [{"role": "user", "content": "Say hello in Spanish."}, {"role": "assistant", "content": "Hola."}],
]
LOCAL = ("127.0.0.1", "::1", "localhost", b"127.0.0.1", b"localhost")
COPIES, BATCH = 4, 4            # 16 rows, 4 steps: every conversation is trained on several times


@pytest.fixture(scope="module")
def base():
    return load_base_model(BASE, device="cpu")


@pytest.fixture
def offline(monkeypatch):
    """Connections to this machine only; any other is refused and recorded (the test then fails)."""
    attempts: list = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def refused(where) -> OSError:
        attempts.append(where)
        return OSError(f"test_tinker_cookbook: no network ({where})")

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
            raise refused(address)
        return connect(sock, address)

    def local_names(host, *args, **kwargs):
        if host not in LOCAL and host is not None:
            raise refused(host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    monkeypatch.setattr(socket, "getaddrinfo", local_names)
    # the cookbook's training loops fetch a price list once per process and log token counts without it: the
    # state after a failed fetch, so that it is not tried
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    monkeypatch.setattr(cost_estimation, "_pricing_entries", None)
    yield attempts
    assert attempts == [], f"the recipe tried the network: {attempts}"


@pytest.fixture(scope="module")
def service(ray_session, tmp_path_factory):
    """A service whose one trainer holds smollm2-135m, and `aspen http`'s app over it (its Tinker API) with a
    user's token: (the URL, the token, the client)."""
    state = tmp_path_factory.mktemp("state")
    token, _ = UserBook.in_state_dir(state).add("cook")
    client = Client.local(service_config(state, BASE, step_tokens=1024))
    try:
        client.wait_ready(timeout=600)
        app = create_app(ServiceLink(client=client), "t" * 20, users=UserBook.in_state_dir(state),
                         tinker_dir=lambda: state / "tinker")
        with running_server(app) as url:
            yield url, token, client
    finally:
        client.shutdown()


@pytest.fixture
def aspen(service, base, monkeypatch, offline):
    """The service's Tinker API; the cookbook finds the base's tokenizer under the base's name and the server
    through TINKER_API_KEY and its config's base_url."""
    url, token, _ = service
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("TINKER_API_KEY", f"tml-{token}")
    tokenizer_utils.register_tokenizer(BASE, lambda: base.tokenizer)
    try:
        yield url
    finally:
        tokenizer_utils.unregister_tokenizer(BASE)


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_qwen3_instruct_renderer_writes_smollm2s_chat_template(base):
    """The renderer's tokens are those of the tokenizer's own chat template (the reference), but for the
    template's newline after the last <|im_end|>, where the renderer stops: that token is the stop token."""
    renderer = renderers.get_renderer(RENDERER, tokenizer=base.tokenizer)
    for conversation in CONVERSATIONS:
        messages = [SYSTEM, *conversation]
        model_input, weights = renderer.build_supervised_example(messages)
        reference = list(base.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert model_input.to_ints() == reference[:-1] and base.tokenizer.decode(reference[-1:]) == "\n"
        prompt = renderer.build_generation_prompt(messages[:-1]).to_ints()
        assert prompt == list(base.tokenizer.apply_chat_template(
            messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert renderer.get_stop_sequences() == [base.tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.long
def test_the_basic_supervised_recipe_lowers_its_loss(aspen, service, base, tmp_path):
    """recipes/sl_basic.py as its own __main__ runs it (its blueprint, then its main), with what its
    command line would set: the model, the renderer, a conversations file (the dataset it says to swap in),
    the server, a learning rate for 4 steps, a smaller rank."""
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for _ in range(COPIES) for c in CONVERSATIONS))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=BASE, renderer_name=RENDERER, max_length=256,
                                            batch_size=BATCH, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    dataset = FromConversationFileBuilder(common_config=common, file_path=str(data))
    config = sl_basic.build_config_blueprint().apply({
        "model_name": BASE, "renderer_name": RENDERER, "dataset_builder": dataset, "base_url": aspen,
        "log_path": str(tmp_path / "sl"), "learning_rate": 1e-3, "lora_rank": 8}).make()
    sl_basic.main(config)

    steps = metrics(tmp_path / "sl")
    losses = [step["train_mean_nll"] for step in steps]
    assert [step["step"] for step in steps] == list(range(COPIES * len(CONVERSATIONS) // BATCH))
    # step 0 runs the new adapter, which starts as the identity (B = 0): its loss is the base's, computed here
    # by transformers' own model from the same folder on the same batch (the dataset is deterministic: seeded
    # shuffle). Logits agree within 1e-4 in float32 (tests/slow/test_smollm2.py), so each log-probability
    # within 2e-4, and their weighted mean too.
    assert abs(losses[0] - reference_nll(dataset)) <= 2e-4
    # the same 4 conversations, trained on at every step: the last step's loss is far below the first's
    assert losses[-1] < losses[0] / 2, losses
    _, _, client = service   # the recipe's model was a job of the user, ended with its session
    (job,) = [record for record in client.jobs() if record.user == "cook" and record.step == len(steps)]
    assert job.state == "completed" and client.submission(job.id).job.method == "interactive", job


def reference_nll(dataset: FromConversationFileBuilder) -> float:
    """The cookbook's train_mean_nll of the first batch (sum of -logprob * weight over sum of weights), from
    transformers' model of the base."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted_source(resolve_source(BASE)).path, dtype=torch.float32)
    train, _ = dataset()
    train.set_epoch(seed=0)
    total = weight_sum = 0.0
    with torch.no_grad():
        for datum in train.get_batch(0):
            ids = torch.tensor(datum.model_input.to_ints())[None]
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
            weights = torch.tensor(datum.loss_fn_inputs["weights"].data, dtype=torch.float64)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            total -= float((logprobs.gather(1, targets[:, None])[:, 0] * weights).sum())
            weight_sum += float(weights.sum())
    return total / weight_sum


@pytest.mark.long
def test_the_arithmetic_rl_recipe_raises_its_reward(aspen, tmp_path):
    """recipes/math_rl/train.py's CLI config and cli_main, its default environment (arithmetic: "What is x + y?",
    reward 1 for the right sum, minus 0.1 for an answer that does not end with the stop token within
    max_tokens), with `importance_sampling` as the loss (aspen does not serve the recipe's default
    `stable_reinforce`), 4 groups of 4 samples a step, 3 steps."""
    config = math_rl.CLIConfig(model_name=BASE, renderer_name=RENDERER, base_url=aspen, log_path=str(tmp_path / "rl"),
                               loss_fn="importance_sampling", lora_rank=8, learning_rate=1e-3, group_size=4,
                               groups_per_batch=4, max_steps=3)
    asyncio.run(math_rl.cli_main(config))

    steps = [step for step in metrics(tmp_path / "rl") if "env/all/reward/total" in step]
    assert [step["step"] for step in steps] == [0, 1, 2]
    rewards = [step["env/all/reward/total"] for step in steps]
    formats = [step["env/all/format"] for step in steps]
    for step in steps:   # the reward is what the environment defines, from its two parts
        parts = step["env/all/correct"] + 0.1 * (step["env/all/format"] - 1)
        assert step["env/all/reward/total"] == pytest.approx(parts)
    # The base answers at length and rarely stops within 5 tokens; the samples that stopped get the positive
    # advantages, so the first update teaches the policy to stop: the format part of the reward rises at the next
    # step (runs: 0.3125 / 0.375 / 0.4375 / 0.5 -> 0.9375 / 0.9375 / 0.9375 / 1.0; sampling is not seeded, so step 0
    # differs run to run). Only that rise is asserted: once most samples stop, a group's advantages come from its
    # chance sums alone and the next update may move the format either way (CI, 2026-12-01: 0.4375 -> 0.9375 ->
    # 0.4375), and where step 0's samples stopped more often than usual the first update's push is weaker: one of the
    # two later steps rises above step 0 (CI, 2026-12-04: 0.625 -> 0.5625 -> 1.0). (135M parameters do not learn to
    # add in 3 steps: `correct` is chance, and not asserted. Nor is the total: one lucky right sum among a step's 16
    # samples moves it by 1/16 = 0.0625, more than the format part can rise, 0.1 x (1 - format at step 0) <= 0.05
    # here; a run on 2026-11-29 had rewards 0.0125 -> 0.0.)
    assert max(formats[1:]) > formats[0], (formats, rewards)
