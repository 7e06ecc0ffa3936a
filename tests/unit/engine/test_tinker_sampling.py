"""Sampling as the Tinker API defines it (actors/engine/tinker_sampling.py) against independent references:
temperature 0 gives transformers' greedy `generate` on the PEFT model with the same adapter merged; a sampled
token's log-probability is the one a forward pass of the prompt and the tokens before it gives; the same seed
draws the same samples whatever shares the batch; top_p small enough leaves only the likeliest token; a stop
token ends a sample with its reason, and the prompt's log-probabilities are the forward pass's."""

from __future__ import annotations

import pytest
import torch

from actors.engine.models import from_module
from actors.engine.tinker_sampling import SampleCall, sample
from tests.helpers.interactive import peft_twin, random_b_model
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

pytestmark = pytest.mark.unit
PROMPT = (5, 17, 3, 99, 42, 7)


@pytest.fixture(scope="module")
def setup():
    base = from_module(tiny_model("llama", VOCAB), None)
    return base, random_b_model(base, "alice-0", 4, 1, scale=0.5)


def peft_reference(model):
    return peft_twin(model)[0].merge_and_unload().eval()


def test_temperature_zero_is_transformers_greedy_generate_on_the_merged_adapter(setup):
    base, model = setup
    (result,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=12, temperature=0.0)])
    merged = peft_reference(model)
    expected = merged.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert result.sequences[0].tokens == expected
    assert result.sequences[0].stop_reason == "length"


def test_sampled_logprobs_are_the_forward_pass_of_prompt_and_tokens(setup):
    base, model = setup
    (result,) = sample(base, [SampleCall("alice-0", PROMPT, num_samples=2, max_tokens=8, seed=11)])
    merged = peft_reference(model)
    for sequence in result.sequences:
        ids = torch.tensor([PROMPT + tuple(sequence.tokens)])
        with torch.no_grad():
            logprobs = torch.log_softmax(merged(ids).logits[0].float(), dim=-1)
        expected = [float(logprobs[len(PROMPT) - 1 + i, token]) for i, token in enumerate(sequence.tokens)]
        bound = rounding_tolerance(llama_chain_terms(merged.config, sequence=ids.shape[1], tokens=1, backward=False),
                                   max(abs(v) for v in expected))
        assert len(sequence.logprobs) == len(sequence.tokens)
        assert max(abs(a - b) for a, b in zip(sequence.logprobs, expected, strict=True)) <= bound


def test_the_same_seed_draws_the_same_samples_whatever_shares_the_batch(setup):
    base, _ = setup
    call = SampleCall("alice-0", PROMPT, num_samples=3, max_tokens=10, seed=7, top_k=20, top_p=0.9)
    (alone,) = sample(base, [call])
    other = SampleCall(None, (1, 2, 3), num_samples=2, max_tokens=4, seed=1)
    shared, _ = sample(base, [call, other])
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in shared.sequences]
    assert len({tuple(s.tokens) for s in alone.sequences}) > 1   # three different samples
    (again,) = sample(base, [SampleCall("alice-0", PROMPT, num_samples=3, max_tokens=10, seed=8, top_k=20)])
    assert [s.tokens for s in again.sequences] != [s.tokens for s in alone.sequences]


def test_a_tiny_top_p_keeps_only_the_likeliest_token(setup):
    base, _ = setup
    (greedy,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=8, temperature=0.0)])
    (nucleus,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=8, top_p=1e-6, seed=3)])
    assert nucleus.sequences[0].tokens == greedy.sequences[0].tokens


def test_a_stop_token_ends_the_sample_and_prompt_logprobs_are_the_forward_pass(setup):
    base, model = setup
    (greedy,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=8, temperature=0.0)])
    stop = greedy.sequences[0].tokens[2]
    first = greedy.sequences[0].tokens.index(stop)
    (stopped,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=8, temperature=0.0,
                                          stop_tokens=frozenset({stop}), prompt_logprobs=True)])
    assert stopped.sequences[0].tokens == greedy.sequences[0].tokens[:first + 1]
    assert stopped.sequences[0].stop_reason == "stop"
    merged = peft_reference(model)
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    expected = [float(logprobs[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert stopped.prompt_logprobs[0] is None
    assert stopped.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_bad_parameters_are_refused_naming_them(setup):
    base, _ = setup
    with pytest.raises(ValueError, match="top_p"):
        sample(base, [SampleCall("alice-0", PROMPT, top_p=0.0)])
    with pytest.raises(ValueError, match="outside the base's vocabulary"):
        sample(base, [SampleCall("alice-0", (VOCAB + 1,))])
    with pytest.raises(ValueError, match="stop strings need the base's tokenizer"):
        sample(base, [SampleCall("alice-0", PROMPT, stop_texts=("\n",))])


def test_top_k_of_the_prompt_and_of_each_sampled_token_are_the_forward_pass_s(setup):
    """topk_prompt (top-k distillation's teacher), topk_sample and prompt_last_n against log_softmax of the merged
    PEFT model's forward: the k likeliest tokens at each position with their log-probabilities, unscored positions
    None; a last_n outside the prompt is refused."""
    base, model = setup
    (result,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=5, seed=3, prompt_logprobs=True,
                                         topk_prompt=4, topk_sample=3, prompt_last_n=3)])
    merged = peft_reference(model)
    sequence = result.sequences[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(torch.tensor([PROMPT + tuple(sequence.tokens)])).logits[0].float(), -1)
    bound = rounding_tolerance(llama_chain_terms(merged.config, sequence=len(PROMPT) + 5, tokens=1, backward=False),
                               float(logprobs.abs().max()))
    first = len(PROMPT) - 3
    assert result.prompt_logprobs[:first] == [None] * first and result.topk_prompt[:first] == [None] * first
    assert len(result.prompt_logprobs) == len(result.topk_prompt) == len(PROMPT)
    for position in range(first, len(PROMPT)):
        values, ids = logprobs[position - 1].topk(4)
        ours_ids, ours_values = result.topk_prompt[position]
        assert ours_ids == ids.tolist(), position
        assert max(abs(a - b) for a, b in zip(ours_values, values.tolist(), strict=True)) <= bound
        assert abs(result.prompt_logprobs[position] - float(logprobs[position - 1, PROMPT[position]])) <= bound
    assert len(sequence.topk) == len(sequence.tokens) == 5
    for index, (ours_ids, ours_values) in enumerate(sequence.topk):
        values, ids = logprobs[len(PROMPT) - 1 + index].topk(3)
        assert ours_ids == ids.tolist()
        assert max(abs(a - b) for a, b in zip(ours_values, values.tolist(), strict=True)) <= bound
    (only_topk,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=1, topk_prompt=2)])
    assert only_topk.prompt_logprobs is None and only_topk.topk_prompt[0] is None
    assert len(only_topk.topk_prompt) == len(PROMPT) and not only_topk.sequences[0].topk
    with pytest.raises(ValueError, match=r"prompt_logprobs_last_n must be 1..5"):
        sample(base, [SampleCall("alice-0", PROMPT, prompt_logprobs=True, prompt_last_n=len(PROMPT))])


def test_target_cells_and_alternative_draws_are_the_forward_pass_s(setup):
    """target_prompt_logprobs' cells (row i: position i + 1) and prompt_alt_tokens_k's draws against log_softmax of
    the merged PEFT model's forward: each asked token's log-probability; temperature 0 draws the likeliest token k
    times; a seed draws the same tokens again, each with its log-probability; a cell outside the vocabulary or the
    shape is refused."""
    from actors.engine.prompt_scores import TargetCells

    base, model = setup
    cells = TargetCells((len(PROMPT) - 1, 2), ((1, 0, 7), (1, 1, 250), (4, 1, 3)))
    (result,) = sample(base, [SampleCall("alice-0", PROMPT, max_tokens=1, target_cells=cells, alt_k=3,
                                         temperature=0.0)])
    merged = peft_reference(model)
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    bound = rounding_tolerance(llama_chain_terms(merged.config, sequence=len(PROMPT), tokens=1, backward=False),
                               float(logprobs.abs().max()))
    asked, values = result.prompt.target
    assert asked == cells
    assert max(abs(value - float(logprobs[row, token])) for (row, _, token), value in
               zip(cells.cells, values, strict=True)) <= bound
    tokens, alt_logprobs = result.prompt.alt
    assert tokens == [[int(logprobs[row].argmax())] * 3 for row in range(len(PROMPT) - 1)]
    assert max(abs(v - float(logprobs[row, t])) for row in range(len(PROMPT) - 1)
               for t, v in zip(tokens[row], alt_logprobs[row], strict=True)) <= bound
    drawn = [sample(base, [SampleCall("alice-0", PROMPT, max_tokens=1, alt_k=4, seed=9)])[0].prompt.alt[0]
             for _ in range(2)]
    assert drawn[0] == drawn[1] and len({t for row in drawn[0] for t in row}) > len(PROMPT) - 1   # not all argmax
    with pytest.raises(ValueError, match=r"cell \(0, 0\) asks for token .*outside the vocabulary"):
        sample(base, [SampleCall("alice-0", PROMPT, target_cells=TargetCells((len(PROMPT) - 1, 1),
                                                                            ((0, 0, VOCAB),)))])
    with pytest.raises(ValueError, match=r"target_prompt_logprobs has 2 rows; it needs one per prompt position"):
        sample(base, [SampleCall("alice-0", PROMPT, target_cells=TargetCells((2, 1), ()))])


def test_calls_to_the_last_position_of_a_learned_position_base_share_a_batch():
    """Two calls within a GPT-2 base's 32 learned positions (one sampling to its last position, one ending
    earlier) in one decoding batch: each gets transformers' own greedy `generate` on the base (the row that ended was
    fed on, past its last position, while the other decoded: an IndexError that failed the whole batch)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    base = from_module(model, None)
    calls = [SampleCall(None, tuple(range(5, 36)), max_tokens=2, temperature=0.0),
             SampleCall(None, (5, 6, 7), max_tokens=20, temperature=0.0)]
    results = sample(base, calls)
    for call, result in zip(calls, results, strict=True):
        expected = model.generate(torch.tensor([call.prompt]), max_new_tokens=call.max_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(call.prompt):].tolist()
        assert result.sequences[0].tokens == expected
