"""The Tinker API tests' server and helpers (tests/servers/test_tinker_{api,sampling,checkpoints}.py): the API served
in this process by uvicorn over a tiny base, the checkpoint ledger's clock (the `sdk_server` and `ledger_clock` fixtures
of tests/servers/conftest.py), a user's supervised loop through the real SDK (`sdk_loop`) and the same calls on aspen's
engine (`engine_reference`), the adapter a sampler path names, greedy samples."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import adapter_name
from orchestrator.tinker.tinker_routes import TinkerBackend
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import datums, tinker_in_process

BASE = "tiny-llama"
WINDOW_S = 0.25   # how long a call waits for partners: wide, so that two users' calls sent together meet
KEYS = {"alice-token": "alice", "bob-token": "bob"}
ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@contextlib.contextmanager
def served_tiny_base(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, TinkerBackend, list[dict]]]:
    """The Tinker API served in this process (uvicorn) over a fresh tiny Llama, its weights under `folder`:
    (url, backend, steps). tests/servers/conftest.py's `sdk_server`."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, folder / "weights", KEYS.get,
                           window_s=WINDOW_S) as served:
        yield served


def movable_ledger_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The checkpoint ledger's clock, which a test moves (clock[0] += seconds). tests/servers/conftest.py's
    `ledger_clock`."""
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
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
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


def greedy(sampler, prompt: list[int]):
    return sampler.sample(types.ModelInput.from_ints(prompt), 1,
                          types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                          include_prompt_logprobs=True).result()


def same_samples(result, reference) -> None:
    """The same greedy sequence, its log-probabilities and the prompt's, bit for bit."""
    assert result.sequences[0].tokens == reference.sequences[0].tokens
    assert result.sequences[0].logprobs == reference.sequences[0].logprobs
    assert result.prompt_logprobs == reference.prompt_logprobs
