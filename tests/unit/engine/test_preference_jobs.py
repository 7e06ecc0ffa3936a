"""Preference jobs (method dpo / orpo / cpo): DPO, ORPO, CPO and SFT jobs in one fused step each train exactly
as alone; bad preference data and specs are refused naming the fix; preference rows from parquet (with a column
mapping, whole or streamed) give the JSONL file's pairs, and chat rows follow the chat template as TRL's
DPOTrainer finds it; a DPO job runs through the in-process service, resumes mid-accumulation exactly as
uninterrupted and trains alike in every layout, and computes each pair's reference forward once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from actors.data import DataError, PreferenceFormat, load_examples
from actors.data.pairs import PreferencePair, tokenize_pair
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.run_spec import RunSpec
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.pairs import ROWS, random_pairs
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance


@pytest.mark.parametrize("config", ["float32", "float16", "qwen3_moe", "qwen3_moe experts"])
def test_dpo_orpo_and_sft_jobs_in_one_fused_step_train_exactly_as_alone(config):
    """Two DPO jobs (their references from one shared no-adapter forward), an SFT job, an ORPO job with
    dropout and accumulation and a CPO job: each one's losses and adapter equal its solo run's exactly (CPU; float16:
    each job with its own loss scale; an MoE base, whose experts group the reference pass's rows by job too; and
    there every job but ORPO, whose dropout the stacks do not take, with LoRA on the expert stacks too)."""
    from actors.engine.models import from_module
    from tests.helpers.isolation import VOCAB, assert_isolated, base_for
    from tests.helpers.model_families import build_config, build_model

    stacks = ["experts.gate_up_proj", "experts.down_proj"] if config.endswith("experts") else []
    config = config.split()[0]
    common = {"data": "unused.jsonl", "lr": 1e-2, "warmup_steps": 1,
              "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear", "target_parameters": stacks}}
    jobs = [(JobSpec(name="dpo", format={"type": "preference"}, method="dpo", batch_size=2, max_steps=2,
                     **common), random_pairs(0, 6, VOCAB), 0),
            (JobSpec(name="sft", format={"type": "text"}, batch_size=3, max_steps=2, **common),
             random_examples(1, count=6, vocab=VOCAB), 1),
            (JobSpec(name="dpo-2", format={"type": "preference"}, method="dpo", batch_size=1, max_steps=2,
                     preference={"beta": 0.3}, **common), random_pairs(3, 4, VOCAB), 3),
            (JobSpec(name="orpo", format={"type": "preference"}, method="orpo", batch_size=3, grad_accum=2,
                     max_steps=1, preference={"beta": 0.5}, **{**common, "lora": {"r": 2, "alpha": 4,
                                                                               "dropout": 0.1}}),
             random_pairs(2, 6, VOCAB), 2),
            (JobSpec(name="cpo", format={"type": "preference"}, method="cpo", batch_size=2, max_steps=2,
                     preference={"beta": 0.2, "cpo_alpha": 0.5}, **common), random_pairs(4, 4, VOCAB), 4)]
    base = (from_module(build_model(build_config(config, vocab_size=VOCAB)), None) if config == "qwen3_moe"
            else base_for(config))
    assert_isolated(base, jobs)


def test_preference_specs_and_rows_are_checked(tiny_tokenizer, tmp_path):
    with pytest.raises(ValidationError, match="method 'dpo' learns from preference pairs: set format to"):
        JobSpec(name="a", data="x.jsonl", format={"type": "alpaca"}, method="dpo")
    with pytest.raises(ValidationError, match="set method to dpo, orpo or cpo"):
        JobSpec(name="a", data="x.jsonl", format={"type": "preference"})
    with pytest.raises(ValidationError, match="train_on_prompt does not apply to method dpo"):
        JobSpec(name="a", data="x.jsonl", format={"type": "preference"}, method="dpo", train_on_prompt=True)
    with pytest.raises(ValidationError, match="2 sequences per preference pair"):
        RunSpec(step_tokens=1024, jobs=[JobSpec(name="a", data="x.jsonl", format={"type": "preference"},
                                                method="dpo", batch_size=2, max_seq_len=512)])
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "Hi", "chosen": " Hello"}) + "\n")
    with pytest.raises(DataError) as caught:
        load_examples(data, PreferenceFormat(), tiny_tokenizer, max_seq_len=64)
    assert caught.value.line == 2 and caught.value.field == "rejected"
    assert str(caught.value).startswith(f"{data}:2: field 'rejected' is missing")
    data.write_text(json.dumps({"prompt": "Hi", "chosen": " Hello", "rejected": ["not", "text"]}) + "\n")
    with pytest.raises(DataError, match=r":1: field 'rejected' must be a string, got list"):
        load_examples(data, PreferenceFormat(), tiny_tokenizer, max_seq_len=64)


def test_preference_rows_from_parquet_with_columns_whole_and_streamed_equal_the_jsonl_pairs(tiny_tokenizer, tmp_path):
    """The dataset sources (parquet, a column mapping, streaming: actors/data/dataset.py, streaming.py)
    give a preference job the same pairs as its JSONL file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actors.data.dataset import load_dataset_examples
    from actors.data.streaming import open_stream

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    expected = load_examples(tmp_path / "pairs.jsonl", PreferenceFormat(), tiny_tokenizer, max_seq_len=64).examples
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "pairs.parquet", row_group_size=1)
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    whole = load_dataset_examples(tmp_path / "pairs.parquet", PreferenceFormat(), tiny_tokenizer, max_seq_len=64,
                                  columns=columns).examples
    assert whole == expected and all(isinstance(pair, PreferencePair) for pair in whole)
    stream = open_stream(tmp_path / "pairs.parquet", PreferenceFormat(), tiny_tokenizer, max_seq_len=64,
                         columns=columns, batch_size=len(ROWS), seed=0, epochs=None, shuffle_window=0)
    assert stream.cursor.next_batch() == expected
    with pytest.raises(DataError, match=r"pairs.jsonl:1: column 'question' is missing .*the row's columns: "
                                        r"chosen, prompt, rejected"):
        load_dataset_examples(tmp_path / "pairs.jsonl", PreferenceFormat(), tiny_tokenizer, max_seq_len=64,
                              columns=columns)


def test_chat_preference_rows_follow_the_chat_template(tiny_tokenizer):
    """A chat row: the completion starts where the prompt rendered with the generation prompt ends, as TRL's
    DPOTrainer finds it."""
    row = {"prompt": [{"role": "user", "content": "Say hi"}], "chosen": "Hello!",
           "rejected": [{"role": "assistant", "content": "No."}]}
    pair = tokenize_pair(row, PreferenceFormat(), tiny_tokenizer, max_seq_len=512)
    prompt = tiny_tokenizer.apply_chat_template(row["prompt"], tokenize=True, return_dict=True,
                                                add_generation_prompt=True)["input_ids"]
    full = tiny_tokenizer.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": "Hello!"}],
                                              tokenize=True, return_dict=True)["input_ids"]
    assert list(pair.chosen.input_ids) == list(full) and pair.prompt_length == len(prompt)
    assert list(pair.chosen.labels[len(prompt):]) == list(full[len(prompt):])
    assert set(pair.chosen.labels[:len(prompt)]) == {-100}
    assert "Hello!" in tiny_tokenizer.decode(full[len(prompt):])


IMPLICIT = [  # Anthropic HH-RLHF's rows: the whole dialogue as text in each
    {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: It is 4.",
     "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: Five, I think."},
    {"chosen": "\n\nHuman: Name a colour.\n\nAssistant: Blue.", "rejected": "\n\nHuman: Name a colour.\n\nAssistant: Bl"
                                                                     "ack is not one."},
    # whole conversations, no prompt (TRL's implicit prompt, conversational)
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello there!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Go away"}]},
    # UltraFeedback's rows: a text prompt beside whole conversations
    {"prompt": "Count to three",
     "chosen": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"},
                {"role": "assistant", "content": "1, 2, 3"}],
     "rejected": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"},
                  {"role": "assistant", "content": "No."}]}]


def test_rows_with_an_implicit_prompt_give_trls_sequences(tiny_tokenizer, tmp_path):
    """Rows without a prompt of their own (HH-RLHF's text, whole conversations) or with a text prompt beside whole
    conversations (UltraFeedback): the pairs are the sequences TRL's DPOTrainer makes of the same rows."""
    from trl import maybe_extract_prompt

    from tests.helpers.pairs import trl_pairs

    for number, row in enumerate(IMPLICIT):
        # DPOTrainer takes the prompt out of rows without one; of the text prompt beside conversations, TRL's
        # maybe_extract_prompt
        _, _, expected = trl_pairs([maybe_extract_prompt(row) if "prompt" in row else row], tiny_tokenizer,
                                   tmp_path / str(number))
        assert tokenize_pair(row, PreferenceFormat(), tiny_tokenizer, max_seq_len=512) == expected[0], row
    pair = tokenize_pair(IMPLICIT[0], PreferenceFormat(), tiny_tokenizer, max_seq_len=512)
    assert tiny_tokenizer.decode(pair.chosen.input_ids[:pair.prompt_length]).endswith("Assistant:")


def test_implicit_prompts_that_cannot_be_taken_are_refused(tiny_tokenizer, tmp_path):
    user = {"role": "user", "content": "Hi"}
    bad = [({"chosen": "Hello", "rejected": "Go away"}, "prompt", r"field 'prompt' is missing, and 'chosen' and "
            r"'rejected' share no beginning to take as the prompt \(the row has: chosen, rejected\); set prompt_field"),
           ({"chosen": "Q: a", "rejected": "Q: a and b"}, "rejected", "the same up to the end of one of them"),
           ({"chosen": [user, {"role": "assistant", "content": "A"}, user], "rejected": [user]}, "rejected",
            "the same up to the end of one of them"),
           ({"chosen": [user, {"role": "user", "content": "again"}], "rejected": [user, user]}, "chosen[1].role",
            r"field 'chosen\[1\].role' is 'user': the prompt is the turns chosen and rejected share"),
           ({"chosen": [user], "rejected": "text"}, "rejected", "must both be text or both lists of messages"),
           ({"prompt": "Hi", "chosen": [{"role": "assistant", "content": "A"}],
             "rejected": [{"role": "assistant", "content": "B"}]}, "prompt",
            "field 'prompt' is text while 'chosen' and 'rejected' are messages that share no turn")]
    for row, field, message in bad:
        data = tmp_path / "pairs.jsonl"
        data.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError, match=message) as caught:
            load_examples(data, PreferenceFormat(), tiny_tokenizer, max_seq_len=64)
        assert str(caught.value).startswith(f"{data}:2: ") and caught.value.field == field


def test_a_dpo_job_runs_through_the_in_process_service(tiny_model_dirs, tmp_path):
    from actors.service.scheduler.local_run import train_locally

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    spec = RunSpec(base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "runs", step_tokens=1024,
                   jobs=[{"name": "prefer", "data": str(data), "format": {"type": "preference"}, "method": "dpo",
                          "batch_size": 2, "max_steps": 3, "max_seq_len": 64, "eval_split": 2, "eval_every": 3,
                          "lr": 2e-2, "lora": {"r": 4, "alpha": 8}}])
    (prefer,) = train_locally(spec, progress=False)
    assert prefer.state == "completed" and prefer.steps == 3, prefer.reason
    assert abs(prefer.first_loss - 0.6931) < 1e-3   # DPO starts at log 2: the adapter starts as a no-op
    assert prefer.final_loss < prefer.first_loss
    assert [step for step, _ in prefer.evals] == [3] and prefer.eval_loss < 0.6931
    rows = [json.loads(line) for line in (Path(prefer.adapter_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all("rewards/margins" in row and "rewards/accuracies" in row for row in rows)


def _dpo_spec(**changes) -> JobSpec:
    return JobSpec(name="dpo", data="unused.jsonl", format={"type": "preference"}, method="dpo",
                   **{"batch_size": 2, "grad_accum": 2, "max_steps": 2, "lr": 1e-2,
                      "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}, **changes})


def _train_dpo(base, pairs, *, layout: str = "packed", interrupt_after: int | None = None, folder=None,
               resume_from=None):
    """A DPO job trained to its end in `layout`: its adapter, its metrics rows, and each micro-batch's gradient
    (what its backward pass adds to each adapter parameter). With `interrupt_after`, checkpointed into `folder`
    after that many micro-batches (mid-accumulation) and resumed on a fresh trainer; with `resume_from`,
    started from that checkpoint."""
    from actors.checkpoint import load_checkpoint, save_checkpoint

    gradients: list[dict[str, torch.Tensor]] = []

    def start(checkpoint) -> tuple[FusedTrainer, TrainingJob]:
        trainer = FusedTrainer(base, layout=layout)
        job = TrainingJob.create(_dpo_spec(), base, pairs, [], seed=0)
        if checkpoint is not None:
            load_checkpoint(job, checkpoint)
        trainer.add_job(job)
        return trainer, job

    def step(trainer: FusedTrainer, job: TrainingJob) -> None:
        added: dict[str, torch.Tensor] = {}
        hooks = [parameter.register_hook(lambda grad, name=name: added.__setitem__(name, grad.detach().clone()))
                 for name, parameter in job.adapter.named_parameters()]
        trainer.train_step()
        for hook in hooks:
            hook.remove()
        gradients.append(added)

    trainer, job = start(resume_from)
    if interrupt_after is not None:
        for _ in range(interrupt_after):
            step(trainer, job)
        assert job.accumulator.micro_batches == 1 and job.accumulator.metric_sums
        save_checkpoint(job, folder, "tiny")
        trainer.remove_job(job.name)
        trainer, job = start(folder)
    while not job.done:
        step(trainer, job)
    weights = {name: p.detach().clone() for name, p in job.adapter.named_parameters()}
    trainer.remove_job(job.name)
    return weights, [r.as_row() for r in job.history], gradients


def test_a_dpo_job_resumes_mid_accumulation_and_trains_alike_in_every_layout(tmp_path):
    """Resumed mid-accumulation (after micro-batch 3 of 4), a DPO job ends exactly as uninterrupted: the same
    arithmetic on the same state, so equality. In another layout (padding rows, never targets) the same sums
    run in other orders (attention over padded keys, products of other shapes), so its micro-batches'
    gradients agree within the rounding tolerance of tests/helpers/tolerances.py, each computed from the same state:
    micro-batches 1 and 2 (step 1) from the same initial adapter, micro-batch 4 (step 2) from the checkpoint
    after micro-batch 3.
    Not compared across layouts: the losses (a tolerance derived from the log-probabilities' magnitudes is
    some 0.5% of the loss, far looser than the gradients' 3e-5 of their largest entry, and a loss follows from
    the same sums), and the weights after AdamW, whose update g/(|g|+eps) moves a weight by up to lr·δ/eps for
    a rounding difference δ in a gradient entry near zero (an entry of 5e-8 that differed by 5e-11 between
    the layouts moved its weight by 1.5e-6 on an AMD CPU, 3.2e-6 on an Intel one): no tolerance on them
    follows from the rounding."""
    base = from_module(tiny_model("llama", 300), None)
    pairs = random_pairs(3, 8)
    weights, rows, gradients = _train_dpo(base, pairs)
    # the adapter starts as a no-op (B = 0): the first step's policy is its reference, its margins exactly 0,
    # its loss -log σ(0) = log 2: in float32, the mean of the step's four equal pair losses, each rounded once
    assert len(rows) == 2 and rows[0]["rewards/margins"] == 0.0
    assert abs(rows[0]["loss"] - math.log(2)) <= rounding_tolerance(4, math.log(2))
    resumed_weights, resumed_rows, _ = _train_dpo(base, pairs, interrupt_after=3, folder=tmp_path / "ckpt")
    assert resumed_rows == rows
    for name, value in weights.items():
        assert torch.equal(resumed_weights[name], value), name

    # gradients: the terms along a gradient's chain (sequences of at most `longest` tokens, a micro-batch of two
    # pairs: four sequences), relative to the micro-batch's largest gradient entry: 3e-5 of it here, so that a
    # gradient wrong by more than that fails
    longest = max(len(row) for pair in pairs for row in pair.rows)
    terms = llama_chain_terms(base.model.config, sequence=longest, tokens=4 * longest)
    assert rounding_tolerance(terms, 1.0) < 1e-3
    for layout in ("padded_fused",):
        _, _, padded = _train_dpo(base, pairs, layout=layout)
        _, _, from_checkpoint = _train_dpo(base, pairs, layout=layout, resume_from=tmp_path / "ckpt")
        for ours, theirs in [(gradients[0], padded[0]), (gradients[1], padded[1]), (gradients[3], from_checkpoint[0])]:
            bound = rounding_tolerance(terms, max(float(g.abs().max()) for g in ours.values()))
            for name, value in ours.items():
                assert float((theirs[name] - value).abs().max()) <= bound, (layout, name)


def test_dpo_references_are_computed_once_per_pair_and_reused():
    """Two epochs of four pairs: the reference forward (the decoder run with no adapter in the layout) runs
    in the first epoch's steps only, and training is the same as recomputing it every step."""
    from actors.engine.layout import current_layout
    from actors.engine.preference import ReferenceCache

    base = from_module(tiny_model("llama", 300), None)
    pairs = random_pairs(4, 4)
    reference_forwards = []
    base.decoder.register_forward_hook(lambda *_: reference_forwards.append(current_layout().segments == ()))

    def run(limit: int):
        reference_forwards.clear()
        trainer = FusedTrainer(base)
        job = TrainingJob.create(_dpo_spec(grad_accum=1, max_steps=4), base, pairs, [], seed=0)
        trainer.add_job(job)
        trainer.references.caches[job.name] = ReferenceCache(limit)
        while not job.done:
            trainer.train_step()
        trainer.remove_job(job.name)
        return [r.loss for r in job.history], {n: p.detach().clone() for n, p in job.adapter.named_parameters()}

    cached_losses, cached = run(limit=100)
    assert reference_forwards == [True, False, True, False, False, False]   # steps 3 and 4: no reference
    losses, recomputed = run(limit=0)
    assert reference_forwards.count(True) == 4
    assert cached_losses == losses
    for name, value in recomputed.items():
        assert torch.equal(cached[name], value), name
