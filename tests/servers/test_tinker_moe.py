"""The Tinker API on an MoE base (a tiny random Qwen3-MoE: 4 experts, 2 a token), driven by the real `tinker`
SDK: a LoRA model trains its attention, its LM head (the SDK's default `train_unembed`) and, as Tinker does, its
experts (each expert's own LoRA on the stacks: actors/engine/experts_lora.py), its forward's log-probabilities are
the Hugging Face model's with the PEFT adapter it saved, its sampler samples; a model of the MLP alone adapts the
experts alone."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine.models import from_module
from tests.helpers.model_families import VOCAB, build_config, build_model
from tests.helpers.tinker_sdk import datums, tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

BASE = "tiny-qwen3-moe"
KEYS = {"alice-token": "alice"}
ROWS = [([5, 9, 33, 7, 60, 12, 4, 90], [9, 33, 7, 60, 12, 4, 90, 3], [0, 0, 1, 1, 1, 1, 1, 1]),
        ([71, 2, 45, 88, 19], [2, 45, 88, 19, 6], [0, 1, 1, 1, 1])]


def hf_target_logprobs(model: torch.nn.Module, rows) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].log_softmax(-1)
                .gather(-1, torch.tensor(targets)[:, None])[:, 0] for tokens, targets, _ in rows]


def test_a_moe_base_trains_its_attention_and_experts_through_the_sdk(tmp_path, monkeypatch):
    from peft import PeftModel

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    model = build_model(build_config("qwen3_moe"))
    reference = copy.deepcopy(model)
    with tinker_in_process(from_module(model, None), BASE, tmp_path / "weights", KEYS.get,
                           window_s=0.05) as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        experts_only = client.create_lora_training_client(base_model=BASE, rank=4, train_attn=False,
                                                          train_unembed=False).result()
        experts_only.forward_backward(datums(ROWS), "cross_entropy").result()
        experts_only.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        mlp_folder = experts_only.save_weights_for_sampler("mlp").result().path
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        for _ in range(3):
            training.forward_backward(datums(ROWS), "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        forward = training.forward(datums(ROWS), "cross_entropy").result()
        saved = training.save_weights_for_sampler("s").result()
        sampler = training.create_sampling_client(saved.path)
        sampled = sampler.sample(types.ModelInput.from_ints([5, 9, 33]), 2,
                                 types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)).result()
        assert [len(sequence.tokens) for sequence in sampled.sequences] == [5, 5]
        assert all(0 <= token < VOCAB for sequence in sampled.sequences for token in sequence.tokens)
        client.close("success").result()
        folder = backend.weights_dir / training.model_id.replace(":", "-") / "sampler_weights" / "s"
        mlp = backend.weights_dir / experts_only.model_id.replace(":", "-") / "sampler_weights" / "mlp"
        assert mlp_folder.endswith("/mlp")

    def adapted(peft_model) -> set[str]:
        return {name.split(".lora_")[0].replace(".base_layer", "").rsplit(".", 1)[-1]
                for name, _ in peft_model.named_parameters() if "lora_" in name}

    assert adapted(PeftModel.from_pretrained(copy.deepcopy(reference), mlp)) == {"experts"}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), folder).eval()
    assert adapted(peft_model) == {"q_proj", "k_proj", "v_proj", "o_proj", "experts", "lm_head"}   # SDK's defaults
    expected = hf_target_logprobs(peft_model, ROWS)
    bare = hf_target_logprobs(reference, ROWS)
    for output, want, before in zip(forward.loss_fn_outputs, expected, bare, strict=True):
        got = torch.tensor(output["logprobs"].data)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert float((want - before).abs().max()) > 1e-3   # the adapter trained: the comparison has teeth
