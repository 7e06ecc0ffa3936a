"""Preference training (method dpo / orpo): the loss and the adapter's gradients equal TRL's (DPOTrainer and
the experimental ORPOTrainer, on a PEFT LoRA model with the same weights, the reference being PEFT's model
with its adapter disabled); DPO, ORPO and SFT jobs in one fused step each train exactly as alone; bad
preference data and specs are refused naming the fix; a DPO job runs through the in-process service."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from actors.data import DataError, Example, PreferenceFormat, load_examples
from actors.data.pairs import PreferencePair, tokenize_pair
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.run_spec import RunSpec
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.pairs import random_pairs
from tests.helpers.peft_reference import TARGETS, compare_gradients, copy_peft_lora, peft_config, randomize_b
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

ROWS = [{"prompt": "Question: what is 2+2?\nAnswer:", "chosen": " 4", "rejected": " five, I think"},
        {"prompt": "Name a colour.", "chosen": " Blue is a colour.", "rejected": " A dog"},
        {"prompt": "Say hi", "chosen": " Hello there!", "rejected": " Go away"}]


def _aspen_job(method: str, pairs: list[PreferencePair], peft_model, **spec):
    """aspen's trainer on the same base weights, its adapter a copy of PEFT's; grad_accum 2, so that after
    one fused step the adapter's summed gradients are still there (no optimizer step yet)."""
    base = from_module(tiny_model("llama"), None)
    job_spec = JobSpec(name=method, data="unused.jsonl", format={"type": "preference"}, method=method,
                       batch_size=len(pairs), grad_accum=2, max_steps=5,
                       lora={"r": 4, "alpha": 8, "target_modules": TARGETS}, **spec)
    job = TrainingJob.create(job_spec, base, pairs, [], seed=0)
    copy_peft_lora(job, peft_model)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    return trainer, job


def _tolerances(config, pairs: list[PreferencePair], largest: float, logps: float) -> tuple[float, float]:
    """(gradient, log-prob) tolerances of aspen against TRL (tests/helpers/tolerances.py: the same sums in other
    orders). A gradient entry: the chain through the forward and backward of the pairs' sequences, relative to
    the largest entry. A sequence's log-prob (`logps`: the batch's largest in magnitude): the forward and the
    sum over its tokens; its tokens' log-probs are all <= 0 (no cancellation), and each token's terms (its
    logit and the log-sum-exp) are taken as twice its log-prob (probabilities below 1/2, as in these random
    models)."""
    longest = max(len(row) for pair in pairs for row in pair.rows)
    tokens = sum(len(row) for pair in pairs for row in pair.rows)
    gradient = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=tokens), largest)
    logp = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=longest, backward=False), 2 * logps)
    return gradient, logp


def test_dpo_loss_and_gradients_equal_trl(tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(ROWS), beta=0.1, report_to=[],
                     use_cpu=True)
    # a new adapter (peft_config): TRL's reference is then the base, the adapter disabled (a model that already
    # holds an adapter would get a frozen copy of it as its reference instead)
    trl = DPOTrainer(model=tiny_model("llama"), args=args, train_dataset=Dataset.from_list(ROWS),
                     processing_class=tiny_tokenizer, peft_config=peft_config())
    assert set(trl.model.peft_config) == {"default"}
    peft_model = randomize_b(trl.model, 0)
    batch = next(iter(trl.get_train_dataloader()))
    loss = trl.compute_loss(trl.model, batch)
    loss.backward()
    # TRL's sequences (chosen rows first, then rejected; right padding) as aspen's pairs
    count = batch["input_ids"].shape[0] // 2
    rows = []
    for i in range(2 * count):
        real = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][real].tolist()
        completion = batch["completion_mask"][i][real].bool().tolist()
        rows.append((Example(tuple(ids), tuple(t if c else -100 for t, c in zip(ids, completion, strict=True))),
                     completion.index(True)))
    pairs = [PreferencePair(rows[i][0], rows[count + i][0], rows[i][1]) for i in range(count)]
    # aspen's own tokenization of the rows gives TRL's sequences
    fmt = PreferenceFormat()
    own = {tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512) for row in ROWS}
    assert own == set(pairs)

    trainer, job = _aspen_job("dpo", pairs, peft_model)
    report = trainer.train_step()
    result = report.results[0]
    assert result.optimizer_step is None
    loss_difference = abs(result.loss - loss.item())
    gradient_difference, largest = compare_gradients(job, len(pairs), peft_model)
    print(f"DPO vs TRL: loss {loss.item():.6f}, |loss difference| {loss_difference:.2e}, "
          f"max |gradient difference| {gradient_difference:.2e} (largest {largest:.2e})")
    assert abs(loss.item() - 0.6931) > 1e-3, "the adapter changed nothing: DPO's loss is log 2"
    metrics = job.accumulator.metrics
    # the batch's largest sequence log-prob: at most the pairs' count times the larger mean (all are <= 0)
    logps = len(pairs) * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    gradient_tolerance, logp_tolerance = _tolerances(trainer.base.model.config, pairs, largest, logps)
    print(f"tolerances: gradient {gradient_tolerance:.2e}, log-prob {logp_tolerance:.2e}")
    assert gradient_difference <= gradient_tolerance
    # a pair's loss -log σ(β·margin) moves at most β times its margin, a sum of four log-probs (policy and
    # reference, chosen and rejected)
    beta = job.spec.preference.beta
    assert loss_difference <= beta * 4 * logp_tolerance
    # the reward metrics are TRL's: β times two log-probs (chosen, rejected), four (margins); the accuracies
    # (the share of margins > 0) exactly: a margin would have to lie within its tolerance of 0 to flip one
    logged = trl._metrics["train"]
    reward = beta * 2 * logp_tolerance
    for name, tolerance in (("rewards/chosen", reward), ("rewards/rejected", reward),
                            ("rewards/margins", 2 * reward), ("logps/chosen", logp_tolerance)):
        assert abs(metrics[name] - logged[name][-1]) <= tolerance, (name, metrics[name], logged[name][-1])
    assert metrics["rewards/accuracies"] == logged["rewards/accuracies"][-1]


def _orpo_trainer(beta: float):
    """TRL's ORPOTrainer's loss code (get_batch_loss_metrics: concatenated forward, NLL, odds ratio) on a
    batch, without its dataset machinery: the attributes those methods read."""
    from trl.experimental.orpo import ORPOTrainer

    trainer = object.__new__(ORPOTrainer)
    trainer.beta = beta
    trainer.is_encoder_decoder = False
    trainer.padding_value = 0
    trainer.aux_loss_enabled = False
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value)
    return trainer


def _orpo_batch(pairs: list[PreferencePair]) -> dict[str, torch.Tensor]:
    """TRL's ORPO batch of `pairs`: chosen_/rejected_ input_ids, attention_mask and labels (the prompt
    masked), right padded."""
    batch = {}
    for side in ("chosen", "rejected"):
        rows = [getattr(pair, side) for pair in pairs]
        longest = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        labels = torch.full((len(rows), longest), -100, dtype=torch.long)
        for i, (row, pair) in enumerate(zip(rows, pairs, strict=True)):
            ids[i, :len(row)] = torch.tensor(row.input_ids)
            mask[i, :len(row)] = 1
            labels[i, pair.prompt_length:len(row)] = torch.tensor(row.input_ids[pair.prompt_length:])
        batch |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    return batch


def test_orpo_loss_and_gradients_equal_trl(tiny_tokenizer):
    beta = 0.25
    fmt = PreferenceFormat()
    # train_on_prompt: the chosen sequence's NLL covers the prompt too, as TRL's ORPOTrainer computes it
    pairs = [tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512, train_on_prompt=True) for row in ROWS]
    from peft import get_peft_model

    peft_model = randomize_b(get_peft_model(tiny_model("llama"), peft_config()), 1)
    loss, metrics = _orpo_trainer(beta).get_batch_loss_metrics(peft_model, _orpo_batch(pairs))
    loss.backward()

    trainer, job = _aspen_job("orpo", pairs, peft_model, preference={"beta": beta}, train_on_prompt=True)
    result = trainer.train_step().results[0]
    loss_difference = abs(result.loss - loss.item())
    gradient_difference, largest = compare_gradients(job, len(pairs), peft_model)
    print(f"ORPO vs TRL: loss {loss.item():.6f}, |loss difference| {loss_difference:.2e}, "
          f"max |gradient difference| {gradient_difference:.2e} (largest {largest:.2e})")
    ours = job.accumulator.metrics
    # ORPO's log-probs are means over each sequence's tokens: their magnitude is the larger mean itself
    logps = len(pairs) * max(abs(ours["logps/chosen"]), abs(ours["logps/rejected"]))
    gradient_tolerance, logp_tolerance = _tolerances(trainer.base.model.config, pairs, largest, logps)
    print(f"tolerances: gradient {gradient_tolerance:.2e}, log-prob {logp_tolerance:.2e}")
    assert gradient_difference <= gradient_tolerance
    # the log-odds of a pair: two mean log-probs, each with log1p(-exp(.)) of it (whose derivative, below 1 for
    # log-probs below -log 2, adds at most as much again); their log-sigmoid moves at most as much; the NLL is a
    # mean log-prob; the loss, NLL - β·log σ(log-odds); the margins, β times two mean log-probs. (Coarse for
    # the log-odds and margins, small differences of log-probs: the gradients, which follow from them, are
    # the close check.)
    odds = 4 * logp_tolerance
    for name, tolerance in (("nll_loss", logp_tolerance), ("log_odds_chosen", odds), ("log_odds_ratio", odds),
                            ("rewards/margins", beta * 2 * logp_tolerance)):
        assert abs(ours[name] - metrics[name]) <= tolerance, (name, ours[name], metrics[name])
    assert loss_difference <= logp_tolerance + beta * odds
    assert ours["rewards/accuracies"] == metrics["rewards/accuracies"]


def _cpo_trainer(beta: float, cpo_alpha: float):
    """TRL's CPOTrainer's loss code (get_batch_loss_metrics: concatenated forward, sigmoid loss, NLL) on a batch,
    without its dataset machinery: the attributes those methods read (loss_type sigmoid, no AlphaPO, no label
    smoothing: its defaults)."""
    from trl.experimental.cpo import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    trainer.beta, trainer.cpo_alpha = beta, cpo_alpha
    trainer.loss_type, trainer.alpha, trainer.label_smoothing, trainer.simpo_gamma = "sigmoid", 0.0, 0.0, 0.5
    trainer.is_encoder_decoder = False
    trainer.pad_token_id = 0
    trainer.aux_loss_enabled = False
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value)
    return trainer


@pytest.mark.parametrize("cpo_alpha", [1.0, 0.0])
def test_cpo_loss_and_gradients_equal_trl(tiny_tokenizer, cpo_alpha):
    beta = 0.2
    fmt = PreferenceFormat()
    # CPO's NLL covers the chosen completion (TRL's labels mask the prompt): no train_on_prompt
    pairs = [tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512) for row in ROWS]
    from peft import get_peft_model

    peft_model = randomize_b(get_peft_model(tiny_model("llama"), peft_config()), 2)
    loss, metrics = _cpo_trainer(beta, cpo_alpha).get_batch_loss_metrics(peft_model, _orpo_batch(pairs))
    loss.backward()

    preference = {"beta": beta} | ({"cpo_alpha": cpo_alpha} if cpo_alpha != 1.0 else {})
    trainer, job = _aspen_job("cpo", pairs, peft_model, preference=preference)
    result = trainer.train_step().results[0]
    loss_difference = abs(result.loss - loss.item())
    gradient_difference, largest = compare_gradients(job, len(pairs), peft_model)
    print(f"CPO vs TRL (cpo_alpha {cpo_alpha}): loss {loss.item():.6f}, |loss difference| {loss_difference:.2e}, "
          f"max |gradient difference| {gradient_difference:.2e} (largest {largest:.2e})")
    ours = job.accumulator.metrics
    logps = len(pairs) * max(abs(ours["logps/chosen"]), abs(ours["logps/rejected"]))
    gradient_tolerance, logp_tolerance = _tolerances(trainer.base.model.config, pairs, largest, logps)
    print(f"tolerances: gradient {gradient_tolerance:.2e}, log-prob {logp_tolerance:.2e}")
    assert gradient_difference <= gradient_tolerance
    # a pair's -log σ(β·margin) moves at most β times its margin (two log-probs); the NLL is a mean log-prob
    for name, tolerance in (("logps/chosen", logp_tolerance), ("rewards/margins", beta * 2 * logp_tolerance),
                            ("nll_loss", logp_tolerance)):
        assert abs(ours[name] - metrics[name]) <= tolerance, (name, ours[name], metrics[name])
    assert loss_difference <= beta * 2 * logp_tolerance + cpo_alpha * logp_tolerance
    assert ours["rewards/accuracies"] == metrics["rewards/accuracies"]
    if cpo_alpha == 0.0:
        assert metrics["nll_loss"] == 0.0 and loss.item() == pytest.approx(result.loss, abs=beta * 2 * logp_tolerance)


@pytest.mark.parametrize("config", ["float32", "float16"])
def test_dpo_orpo_and_sft_jobs_in_one_fused_step_train_exactly_as_alone(config):
    """Two DPO jobs (their references from one shared no-adapter forward), an SFT job, an ORPO job with
    dropout and accumulation and a CPO job: each one's losses and adapter equal its solo run's exactly (CPU; float16:
    each job with its own loss scale)."""
    from tests.helpers.isolation import VOCAB, assert_isolated, base_for

    common = {"data": "unused.jsonl", "lr": 1e-2, "warmup_steps": 1,
              "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}}
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
    assert_isolated(base_for(config), jobs)


def test_dpo_reference_is_the_base_without_any_adapter():
    """The reference log-probabilities are the base model's own (its plain forward, no adapter module),
    whatever the job's adapter holds."""
    from actors.engine.packing import JobMicroBatch
    from actors.engine.preference import reference_log_probs

    model = tiny_model("llama", 300)
    pairs = random_pairs(5, 3)
    with torch.no_grad():
        expected = []
        for pair in pairs:
            for row in pair.rows:
                logits = model(input_ids=torch.tensor([row.input_ids])).logits[0, :-1].log_softmax(-1)
                labels = torch.tensor(row.labels[1:])
                keep = labels != -100
                expected.append(float(logits[keep].gather(1, labels[keep][:, None]).sum()))
    base = from_module(model, None)
    spec = JobSpec(name="dpo", data="unused.jsonl", format={"type": "preference"}, method="dpo", batch_size=3,
                   max_steps=1, lora={"target_modules": "all-linear"})
    job = TrainingJob.create(spec, base, pairs, [], seed=0)
    with torch.no_grad():
        for parameter in job.adapter.parameters():
            parameter.fill_(0.5)   # an adapter that would change every logit
    got = reference_log_probs(base, [JobMicroBatch("dpo", pairs)], 1024)[0].flatten().tolist()
    # the same sums in other orders (a packed forward, a chunked head): each sequence's log-prob within the
    # rounding tolerance of its forward and its tokens' sum (tests/helpers/tolerances.py), its tokens' terms taken as
    # twice its log-prob (all <= 0; probabilities below 1/2 in this random model)
    longest = max(len(row) for pair in pairs for row in pair.rows)
    terms = llama_chain_terms(model.config, sequence=longest, tokens=longest, backward=False)
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= rounding_tolerance(terms, 2 * abs(b)), (a, b)


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
        trainer.reference_caches[job.name] = ReferenceCache(limit)
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


@pytest.mark.parametrize("transform", [{}, {"multiply": 0.5, "softcap": 3.0}])
def test_target_log_probs_backpropagate_any_function_of_them(transform):
    """The chunked head's per-token log-probabilities and their gradient through a nonlinear function of
    per-sequence sums equal plain autograd through the whole logits (with a model's logit transform)."""
    from actors.engine.loss import target_log_probs
    from actors.engine.model_support import LogitTransform

    transform = LogitTransform(**transform)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 40, (50,), generator=generator)
    sequence = torch.arange(50) // 10

    def objective(log_probs):
        sums = torch.zeros(5, dtype=log_probs.dtype).index_add(0, sequence, log_probs)
        return torch.nn.functional.logsigmoid(0.3 * (sums[0::2][:2] - sums[1::2])).sum()

    ours = hidden.clone().requires_grad_(True)
    log_probs = target_log_probs(ours, weight, None, targets, chunk=16, transform=transform)
    objective(log_probs).backward()
    plain = hidden.clone().requires_grad_(True)
    logits = plain @ weight.T * transform.multiply
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    expected = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    objective(expected).backward()
    assert torch.allclose(log_probs.double(), expected, atol=1e-5)
    assert torch.allclose(ours.grad, plain.grad, atol=1e-5) and float(plain.grad.abs().max()) > 1e-3
