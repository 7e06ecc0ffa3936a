"""Layers that carry a state along the row over a packed step (actors/engine/stateful_layers.py), on Qwen3.5's text
model (Gated DeltaNet) and LFM2 (short convolutions) against transformers' model on each sequence alone: a packed
row's sequences get their lone logits (and, without the per-sequence functions, do not: the check has teeth), fused
jobs train exactly as alone (float32 and bfloat16), recomputation gives the same adapters, and a row with a gap after
its last sequence (compile's padding) is cut with the gap a piece of its own. (The fused step against HF + PEFT and
the greedy decoding against HF's `generate`, on qwen3_5_text, qwen3_5_moe_text, qwen3_next, lfm2 and lfm2_moe:
test_model_families.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine import stateful_layers
from actors.engine.job import TrainingJob
from actors.engine.layout import StepLayout, step_layout
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from tests.helpers.fused import job_spec
from tests.helpers.isolation import VOCAB, assert_isolated, four_jobs
from tests.helpers.model_families import build_config, build_model
from tests.helpers.models import random_examples

pytestmark = pytest.mark.unit
TOLERANCE = 1e-5   # relative, float32 on the CPU (as the model table's test)
LEAK = 1e-3        # what the previous sequence changes of the next one's logits without the per-sequence functions


# Qwen3.5 with 32 value heads (below: why), LFM2
STATEFUL = {"qwen3_5_text": {"linear_num_value_heads": 32}, "lfm2": {}}


def stateful(model_type: str, **fields) -> torch.nn.Module:
    return build_model(build_config(model_type, vocab_size=VOCAB, **{**STATEFUL[model_type], **fields}))


def packed_logits(base, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The base's logits over one packed row of `sequences` (positions from 0 in each), cut back per sequence."""
    lengths = [len(tokens) for tokens in sequences]
    ids = torch.tensor([[token for tokens in sequences for token in tokens]])
    positions = torch.tensor([[position for length in lengths for position in range(length)]])
    with torch.no_grad(), step_layout(StepLayout.single("none", lengths)):
        logits = base.model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    return list(logits.split(lengths))


@pytest.mark.parametrize("model_type", list(STATEFUL))
def test_each_packed_sequence_gets_its_lone_logits_and_would_not_without_per_sequence_state(model_type, monkeypatch):
    model = stateful(model_type)
    reference = copy.deepcopy(model)
    assert any(stateful_layers.state_functions(module) for module in model.modules())
    base = from_module(model, None)
    sequences = [example.input_ids for example in random_examples(3, count=3, vocab=VOCAB, min_len=20, max_len=70)]
    alone = []
    with torch.no_grad():
        for tokens in sequences:
            alone.append(reference(input_ids=torch.tensor([tokens]), use_cache=False).logits[0])
    for got, expected in zip(packed_logits(base, sequences), alone, strict=True):
        assert float((got - expected).norm() / expected.norm()) <= TOLERANCE
    monkeypatch.setattr(stateful_layers, "_row_pieces", lambda length: None)   # the row as one sequence
    leaked = packed_logits(base, sequences)
    assert float((leaked[0] - alone[0]).norm() / alone[0].norm()) <= TOLERANCE   # the first has no neighbour
    for got, expected in zip(leaked[1:], alone[1:], strict=True):
        assert float((got - expected).norm() / expected.norm()) > LEAK


@pytest.mark.parametrize("model_type", list(STATEFUL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_stateful_jobs_fused_equal_their_solo_runs_exactly(model_type, dtype):
    """Every operation a job's tokens go through is per token or per sequence (the convolution and the delta rule
    now too), so, as in test_isolation.py, fused jobs end exactly as alone. With one condition from the layer's gates
    (`beta`: a sigmoid, `g`: an exponential of a softplus, over the whole (tokens, value heads) tensor): the CPU's
    vector loop rounds the elements of its scalar tail differently, so where a token's value heads do not fill whole
    iterations of it (2 x 16 floats with AVX-512), whether a token falls in the tail depends on the tokens before it
    (4 value heads: 1e-7 off in float32). 32 fill them whatever the CPU (the released checkpoints: 32 and more).
    The MoE variants' shared expert is gated by a sigmoid of one score a token (as `qwen2_moe`'s): no count of heads
    fills the loop there, so they are fused within float32's rounding, not bit for bit (docs/models.md)."""
    base = from_module(stateful(model_type).to(dtype), None)
    assert_isolated(base, four_jobs())


def _trained(base, recompute: str) -> dict[str, torch.Tensor]:
    spec = job_spec("a", lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}, max_steps=3,
                    lr=1e-2)
    job = TrainingJob.create(spec, base, random_examples(0, vocab=VOCAB, min_len=10, max_len=50), [], seed=0)
    trainer = FusedTrainer(base, recompute=recompute)
    trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    weights = {name: parameter.detach().clone() for name, parameter in job.adapter.named_parameters()}
    trainer.remove_job("a")
    return weights


def test_recomputation_trains_the_same_adapters_bit_for_bit():
    base = from_module(stateful("qwen3_5_text"), None)
    plain, recomputed = _trained(base, "none"), _trained(base, "layers")
    assert any(float(value.abs().max()) > 0 for name, value in plain.items() if "lora_B" in name)
    for name, value in plain.items():
        assert torch.equal(value, recomputed[name]), name


def test_a_gap_after_the_last_sequence_is_a_piece_of_its_own():
    with step_layout(StepLayout.single("a", [5, 7])):
        assert stateful_layers._row_pieces(12) == [5, 7]
        assert stateful_layers._row_pieces(16) == [5, 7, 4]   # compile's padding up to a bucket length
        assert stateful_layers._row_pieces(10) is None        # not this step's row
    with step_layout(StepLayout.single("a", [12])):
        assert stateful_layers._row_pieces(12) is None        # one sequence: transformers' own
    assert stateful_layers._row_pieces(12) is None            # no step


@pytest.fixture
def vision_language_folder(tmp_path, tiny_tokenizer):
    """A Qwen3.5 checkpoint as released: a vision-language model (`model_type: qwen3_5`) whose text model is a
    tiny qwen3_5_text, with the cut SmolLM2 tokenizer (its vocabulary)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.helpers.models import VOCAB as TOKENIZER_VOCAB

    text = build_config("qwen3_5_text", vocab_size=TOKENIZER_VOCAB, linear_num_value_heads=32).to_dict()
    config = Qwen3_5Config(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 32,
                                                             "num_heads": 2, "out_hidden_size": 64})
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "qwen3_5")
    tiny_tokenizer.save_pretrained(tmp_path / "qwen3_5")
    return tmp_path / "qwen3_5", model


def test_a_vision_language_checkpoint_trains_and_merges_its_text_model(vision_language_folder, tmp_path):
    """`base_model` a released Qwen3.5 folder: aspen loads what transformers' AutoModelForCausalLM builds of it (the
    text model, `model_support.causal_lm_config`), whose logits are the vision-language model's on text; a jobs file
    trains on it in process, its adapter loads in PEFT on the same folder, and `aspen export --merge` gives a model
    with PEFT's logits of it. Gemma 3's composite checkpoint, whose causal-LM class is the whole vision-language
    model, stays refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.checkpoint.adapter_export import export_merged
    from actors.engine.model_support import UnsupportedModelError, check_model_support
    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from tests.helpers.service import job_dict, run_spec, write_task_data

    folder, vision_language = vision_language_folder
    base = load_base_model(str(folder), dtype="float32", device="cpu")
    assert type(base.model).__name__ == "Qwen3_5ForCausalLM" and base.model.config.model_type == "qwen3_5_text"
    ids = torch.tensor([[5, 9, 33, 7, 60, 12, 4, 90]])
    with torch.no_grad():
        assert torch.equal(base.model(input_ids=ids, use_cache=False).logits,
                           vision_language(input_ids=ids, use_cache=False).logits)
    data = write_task_data(tmp_path / "data", "task")
    jobs = [job_dict("one", data, 3, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, lr=5e-2)]
    summaries = train_locally(run_spec(str(folder), tmp_path / "out", jobs), base=base, progress=False)
    assert [summary.state for summary in summaries] == ["completed"]
    adapter = tmp_path / "out" / "one"
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                          str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(export_merged(adapter, tmp_path / "merged"),
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
        assert float((expected - base.model(input_ids=ids, use_cache=False).logits).abs().max()) > 1e-4
        got = merged(input_ids=ids, use_cache=False).logits
    # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a few epsilons a layer
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    from transformers import Gemma3Config

    refused = r"model_type 'gemma3' is not in aspen's verified table.*Its text model \(gemma3_text\) is in the table"
    with pytest.raises(UnsupportedModelError, match=refused):
        check_model_support(Gemma3Config())
