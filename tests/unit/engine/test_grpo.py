"""GRPO jobs (method grpo): for fixed completions the loss and the adapter's gradients equal TRL's
GRPOTrainer's (its `_compute_loss` on a PEFT LoRA model with the same weights, the KL reference being PEFT's
model with its adapter disabled), for the dapo and grpo losses with and without the KL term (advantages and
rewards: test_grpo_rewards.py); a GRPO job fused with SFT and DPO jobs
trains exactly as alone (its completions sampled alike, seeded by its own position); a reward that raises,
returns the wrong count or a non-number fails its job alone with a message naming the reward."""

from __future__ import annotations

import math

import pytest
import torch

from actors.data import Example
from actors.data.tokenize import IGNORE_INDEX
from actors.engine.grpo import Rollout
from actors.engine.grpo_replay import GrpoReplay, ReplayedBatch
from actors.engine.grpo_rewards import RewardError
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.grpo_jobs import grpo_spec as _grpo_spec
from tests.helpers.grpo_jobs import number_base as _number_base
from tests.helpers.grpo_jobs import prompt_rows as _prompt_rows
from tests.helpers.isolation import VOCAB, assert_isolated
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.pairs import random_pairs
from tests.helpers.peft_reference import compare_gradients, copy_peft_lora, peft_config, randomize_b
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

G = 3
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
COMPLETIONS = [[[12, 13], [14, 15, 16], [17]], [[18, 19, 20, 21], [22], [23, 24]]]
ADVANTAGES = [[1.1, -0.3, -0.8], [0.0, 0.7, -0.7]]


def _trl_trainer(tiny_tokenizer, tmp_path, *, beta: float, loss_type: str, epsilon_high: float | None = None):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=G * len(PROMPTS), num_generations=G,
                      beta=beta, loss_type=loss_type, report_to=[], use_cpu=True, max_completion_length=8,
                      epsilon_high=epsilon_high,
                      bf16=False)   # TRL's default autocasts the forward to bfloat16, even on a CPU
    trainer = GRPOTrainer(model=tiny_model("llama"), reward_funcs=lambda prompts, completions, **_: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * 6),
        processing_class=tiny_tokenizer, peft_config=peft_config())
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl_inputs(trainer, pad: int, truncated: frozenset[int] = frozenset()) -> dict[str, torch.Tensor]:
    """TRL's inputs for the fixed completions: prompts left-padded, completions right-padded, one row per
    completion; the KL reference from TRL's own log-probabilities with the adapter disabled. `truncated`: the rows
    whose completion mask is zero, as TRL's generation makes it with mask_truncated_completions."""
    rows = [(prompt, completion) for prompt, group in zip(PROMPTS, COMPLETIONS, strict=True) for completion in group]
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    prompt_ids = torch.full((len(rows), width_p), pad)
    prompt_mask = torch.zeros((len(rows), width_p), dtype=torch.long)
    completion_ids = torch.full((len(rows), width_c), pad)
    completion_mask = torch.zeros((len(rows), width_c), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        prompt_ids[i, width_p - len(prompt):] = torch.tensor(prompt)
        prompt_mask[i, width_p - len(prompt):] = 1
        completion_ids[i, :len(completion)] = torch.tensor(completion)
        completion_mask[i, :len(completion)] = 0 if i in truncated else 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor(sum(ADVANTAGES, [])),
              "num_items_in_batch": completion_mask.sum()}
    if trainer.beta:
        with torch.no_grad(), trainer.model.disable_adapter():
            reference, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
                width_c)
        inputs["ref_per_token_logps"] = reference
    return inputs


def _rollouts(truncated: frozenset[int] = frozenset()) -> list[Rollout]:
    """The fixed completions as rollouts; those of `truncated` (rows in TRL's order) masked as `rollouts` masks a
    truncated completion (no targets)."""
    out = []
    for index, (prompt, group, advantage) in enumerate(zip(PROMPTS, COMPLETIONS, ADVANTAGES, strict=True)):
        rows = [index * G + k for k in range(G)]
        completions = tuple(Example(tuple(prompt + c), (IGNORE_INDEX,) * len(prompt) + (
            (IGNORE_INDEX,) * len(c) if row in truncated else tuple(c))) for row, c in zip(rows, group, strict=True))
        out.append(Rollout(completions, len(prompt), (0.0,) * G, ((0.0,),) * G, tuple(advantage),
                           tuple(row in truncated for row in rows)))
    return out


OLD_OFFSETS = (0.5, -0.5, 0.05, -0.3, 0.35)   # old - new log-probability, token by token: ratios e^-0.5 ... e^0.5


def _old_logps(trl, inputs: dict, truncated: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities the completions had "when sampled": the current ones plus OLD_OFFSETS in turn, so that the
    ratios fall below 1 - epsilon, inside and above 1 + epsilon_high: as TRL takes them (rows x completion width)
    and as aspen's replay keeps them (the targets in order)."""
    with torch.no_grad():
        current, _, _ = trl._get_per_token_logps_and_entropies(
            trl.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].shape[1])
    offsets = torch.tensor(OLD_OFFSETS * current.numel())[:current.numel()].view_as(current)
    old = current + offsets
    rows = [c for group in COMPLETIONS for c in group]
    flat = torch.cat([old[i, :len(c)] for i, c in enumerate(rows) if i not in truncated])
    return old, flat


@pytest.mark.parametrize(("loss_type", "beta", "truncated", "replayed"), [
    ("dapo", 0.0, frozenset(), False), ("dapo", 0.04, frozenset(), False), ("grpo", 0.04, frozenset(), False),
    ("dapo", 0.04, frozenset({1, 4}), False), ("grpo", 0.04, frozenset({1, 4}), False),
    ("dapo", 0.04, frozenset(), True), ("grpo", 0.0, frozenset({1, 4}), True)],
    ids=["dapo", "dapo-kl", "grpo-kl", "dapo-kl-masked", "grpo-kl-masked", "dapo-kl-replayed",
         "grpo-masked-replayed"])
def test_grpo_loss_and_gradients_equal_trl_for_fixed_completions(tiny_tokenizer, tmp_path, loss_type, beta,
                                                                 truncated, replayed):
    """`truncated`: completions masked as mask_truncated_completions masks them (TRL: their completion mask zero;
    aspen: no targets), each loss type still over the same completions' tokens or completions as TRL's.
    `replayed`: the completions trained on again (num_iterations), against the log-probabilities they were sampled
    at (TRL's old_per_token_logps; aspen's replay), with an upper clipping range of its own (epsilon_high): the
    ratios clipped below and above, and TRL's clip_ratio metrics."""
    epsilon_high = 0.28 if replayed else None
    trl = _trl_trainer(tiny_tokenizer, tmp_path, beta=beta, loss_type=loss_type, epsilon_high=epsilon_high)
    peft_model = randomize_b(trl.model, 3)
    inputs = _trl_inputs(trl, tiny_tokenizer.pad_token_id, truncated)
    old = None
    if replayed:
        inputs["old_per_token_logps"], old = _old_logps(trl, inputs, truncated)
    peft_model.train()
    loss = trl._compute_loss(peft_model, inputs)
    loss.backward()

    base = from_module(tiny_model("llama"), tiny_tokenizer)
    spec = JobSpec(name="grpo", data="unused.jsonl", format={"type": "prompt_response", "prompt": "{q}",
                                                              "response": "{a}"},
                   method="grpo", grpo={"reward": "exact_match", "num_generations": G, "beta": beta,
                                        "loss_type": loss_type, "epsilon_high": epsilon_high,
                                        "num_iterations": 2 if replayed else 1},
                   batch_size=len(PROMPTS), grad_accum=2, max_steps=5,
                   lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    job = TrainingJob.create(spec, base, _prompt_rows(0, 2), [], seed=0)   # its rows unused: run_step gets rollouts
    copy_peft_lora(job, peft_model)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    rollouts = _rollouts(truncated)
    if replayed:   # the job in its second iteration over these completions
        job.replay = GrpoReplay(2, [ReplayedBatch(rollouts, old)], iteration=1)
    result = trainer.run_step([(job, rollouts)]).results[0]
    assert result.optimizer_step is None
    tokens = sum(len(c) for index, c in enumerate(c for group in COMPLETIONS for c in group) if index not in truncated)
    count = tokens if loss_type == "dapo" else G * len(PROMPTS)
    gradient_difference, largest = compare_gradients(job, count, peft_model)
    longest = max(len(p) + len(c) for p, group in zip(PROMPTS, COMPLETIONS, strict=True) for c in group)
    config = base.model.config
    gradient_tolerance = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=tokens + 20), largest)
    # the loss: advantages times ratios of 1 (exact) plus beta times the KL of log-probs that agree to their
    # rounding (a token's log-prob: the forward over its sequence; the KL's derivative is below 1 there)
    logp = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=longest, backward=False),
                              2 * max(1.0, abs(loss.item())))
    print(f"GRPO ({loss_type}, beta {beta}) vs TRL: loss {loss.item():.6f} / {result.loss:.6f}, max |gradient "
          f"difference| {gradient_difference:.2e} (largest {largest:.2e}, tolerance {gradient_tolerance:.2e})")
    assert gradient_difference <= gradient_tolerance
    # a replay's ratios are e^(logp - old): their loss moves by |advantage| times the ratio per log-prob rounding
    ratio_weight = max(abs(a) for group in ADVANTAGES for a in group) * math.exp(max(OLD_OFFSETS)) if replayed else 0
    assert abs(result.loss - loss.item()) <= 1e-6 + (beta + ratio_weight) * logp
    if beta:
        assert job.accumulator.metrics["kl"] > 0
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert job.accumulator.metrics[name] == pytest.approx(trl._metrics["train"][name][-1], abs=1e-6), name
    if replayed:
        assert 0 < job.accumulator.metrics["clip_ratio/low_mean"] and 0 < job.accumulator.metrics[
            "clip_ratio/high_mean"]   # both clippings acted


def test_a_grpo_job_fused_with_sft_and_dpo_jobs_trains_exactly_as_alone():
    common = {"data": "unused.jsonl", "lr": 1e-2, "warmup_steps": 1,
              "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}}
    jobs = [(_grpo_spec("grpo", "tests.helpers.rewards:sevens"), _prompt_rows(0, 4), 0),
            (JobSpec(name="sft", format={"type": "text"}, batch_size=3, max_steps=2, **common),
             random_examples(1, count=6, vocab=VOCAB), 1),
            (JobSpec(name="dpo", format={"type": "preference"}, method="dpo", batch_size=2, max_steps=2,
                     **common), random_pairs(2, 4, VOCAB), 2),
            (_grpo_spec("grpo-kl", "contains", grpo={"reward": "contains", "num_generations": 3, "max_new_tokens": 4,
                                                     "beta": 0.1, "loss_type": "grpo", "top_k": 20}),
             _prompt_rows(3, 4), 3)]
    assert_isolated(_number_base(), jobs)


@pytest.mark.parametrize(("reward", "message"), [
    ("tests.helpers.rewards:raises", "raised RuntimeError: the reward service is down"),
    ("tests.helpers.rewards:too_few", "returned 1 rewards for 8 completions"),
    ("tests.helpers.rewards:no_such_function", "tests.helpers.rewards has no function 'no_such_function'")])
def test_a_failing_reward_fails_its_job_alone(reward, message):
    base = _number_base()
    trainer = FusedTrainer(base)
    bad = TrainingJob.create(_grpo_spec("bad", reward), base, _prompt_rows(0, 4), [], seed=0)
    good = TrainingJob.create(JobSpec(name="good", data="unused.jsonl", format={"type": "text"}, batch_size=2,
                                      max_steps=2), base, random_examples(1, count=4, vocab=VOCAB), [], seed=1)
    trainer.add_job(bad)
    trainer.add_job(good)
    kept, failed = trainer.rollouts(trainer.compose())
    assert [job.name for job, _ in kept] == ["good"] and [job.name for job, _ in failed] == ["bad"]
    assert isinstance(failed[0][1], RewardError) and message in str(failed[0][1]), failed[0][1]
    assert f"grpo.reward '{reward}'" in str(failed[0][1])
    assert trainer.run_step(kept).results[0].job == "good"        # the others' step goes on
    with pytest.raises(RewardError, match=message):                # alone, train_step says why
        trainer2 = FusedTrainer(base)
        trainer2.add_job(TrainingJob.create(_grpo_spec("bad2", reward), base, _prompt_rows(0, 4), [], seed=0))
        trainer2.train_step()


def test_grpo_specs_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"method grpo needs `grpo: \{reward: ...\}`"):
        JobSpec(name="a", data="x.jsonl", format={"type": "text"}, method="grpo")
    with pytest.raises(ValidationError, match="grpo settings apply to method grpo"):
        JobSpec(name="a", data="x.jsonl", format={"type": "text"}, grpo={"reward": "exact_match"})
    with pytest.raises(ValidationError, match="not preference"):
        JobSpec(name="a", data="x.jsonl", format={"type": "preference"}, method="grpo", grpo={"reward": "contains"})
    with pytest.raises(ValidationError, match=r"not text \(a text row has no prompt"):   # it trained, rewarding nothing
        JobSpec(name="a", data="x.jsonl", format={"type": "text"}, method="grpo", grpo={"reward": "contains"})
    with pytest.raises(ValidationError, match="format text has no prompt .* or remove eval_generate"):
        JobSpec(name="a", data="x.jsonl", format={"type": "text"}, eval_split=4, eval_generate={"metric": "contains"})
    from actors.data.formats import STORED

    # a job an earlier version accepted so, read back from its job table: taken
    kept = {"name": "a", "data": "x.jsonl", "format": {"type": "text"}, "method": "grpo",
            "grpo": {"reward": "contains"}}
    assert JobSpec.model_validate(kept, context={STORED: True}).method == "grpo"
    with pytest.raises(ValidationError, match="reward regex needs pattern"):
        _grpo_spec("a", "regex")
    with pytest.raises(ValidationError, match="neither exact_match, contains, regex nor module:function"):
        _grpo_spec("a", "my reward")
    for field, value in (("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 2.0)):
        with pytest.raises(ValidationError, match=rf"grpo\.{field}"):
            JobSpec(name="a", data="x.jsonl", format={"type": "text"}, method="grpo",
                    grpo={"reward": "contains", field: value})
    from actors.spec.job_spec import step_limit_problem

    problem = step_limit_problem(_grpo_spec("a", "contains", max_seq_len=64), 512)
    assert "batch_size 2 prompts * grpo.num_generations 4 * (max_seq_len 64 + grpo.max_new_tokens 5) = 552" in problem


def test_a_grpo_job_runs_beside_an_sft_job_through_the_in_process_service(tiny_model_dirs, tmp_path):
    """The whole path a user takes: a jobs file with a GRPO job (a built-in reward, the KL term, its held-out
    rows scored by eval_generate) and an SFT job, run by the service in this process: both complete, the
    GRPO job's metrics.jsonl has its rewards per step, and its adapter is a PEFT folder."""
    import json
    from pathlib import Path

    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec
    from tests.helpers.service import job_dict, write_task_data

    data = write_task_data(tmp_path / "data", "arith")
    grpo = job_dict("grpo", data, 3, method="grpo", batch_size=2, eval_split=4, eval_every=3,
                    grpo={"reward": "contains", "num_generations": 3, "max_new_tokens": 6, "beta": 0.05},
                    eval_generate={"metric": "contains", "max_new_tokens": 6})
    spec = RunSpec(base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "runs", step_tokens=2048,
                   jobs=[grpo, job_dict("sft", data, 3)])
    results = {r.name: r for r in train_locally(spec, progress=False)}
    assert results["grpo"].state == "completed" and results["grpo"].steps == 3, results["grpo"].reason
    assert results["sft"].state == "completed", results["sft"].reason
    rows = [json.loads(line) for line in (Path(results["grpo"].adapter_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(0.0 <= row["reward"] <= 1.0 and row["kl"] >= 0 for row in rows), rows
    assert all(row["reward_std"] >= 0 and 0.0 <= row["frac_reward_zero_std"] <= 1.0 for row in rows), rows
    assert "eval_score" in rows[-1]
    assert (Path(results["grpo"].adapter_dir) / "adapter_config.json").is_file()


def test_a_reward_and_a_metric_in_a_file_beside_the_jobs_file_train_as_the_same_functions_imported(
        tiny_model_dirs, tmp_path):
    """`reward: [rewards.py:shorter, rewards.py:sevens]` (weighted) and `metric: rewards.py:score_mean`, a file
    beside the jobs file (named relative to it), run by `aspen run --in-process` from another folder: the job ends
    with the adapter and scores of the same job naming the same functions as an importable module
    (`tests.helpers.rewards:...`), trained by the in-process service, each reward's mean in its metrics. The module
    form of a file that is not importable is refused before anything starts, at its line (in a list too), saying
    to name the file."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from actors.service.scheduler.local_run import train_locally
    from orchestrator.jobs_file import SpecError, load_run_spec
    from tests.helpers.service import adapter_tensors, job_dict, write_task_data

    repo = Path(__file__).resolve().parents[3]
    folder = tmp_path / "project"
    data = write_task_data(folder / "data", "arith")
    shutil.copy(repo / "tests" / "helpers" / "rewards.py", folder / "rewards.py")

    def jobs(reward: str | list[str], metric: str, output: str) -> dict:
        weights = {"reward_weights": [1.0, 0.5]} if isinstance(reward, list) else {}
        job = job_dict("grpo", data, 3, method="grpo", batch_size=2, eval_split=4, eval_every=3,
                       grpo={"reward": reward, "num_generations": 3, "max_new_tokens": 6, **weights},
                       eval_generate={"metric": metric, "max_new_tokens": 6})
        return {"base_model": str(tiny_model_dirs["llama"]), "output_dir": output, "step_tokens": 2048, "jobs": [job]}

    (folder / "jobs.yaml").write_text(yaml.safe_dump(jobs(["rewards.py:shorter", "rewards.py:sevens"],
                                                          "rewards.py:score_mean", "out")))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "--quiet",
                           str(folder / "jobs.yaml")], cwd=elsewhere, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-3000:]

    (folder / "module.yaml").write_text(yaml.safe_dump(jobs(["tests.helpers.rewards:shorter",
                                                             "tests.helpers.rewards:sevens"],
                                                            "tests.helpers.rewards:score_mean", "reference")))
    (reference,) = train_locally(load_run_spec(folder / "module.yaml"), progress=False)
    assert reference.state == "completed", reference.reason
    got, want = adapter_tensors(folder / "out" / "grpo"), adapter_tensors(Path(reference.adapter_dir))
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)
    assert any(float(t.abs().max()) > 0 for name, t in want.items() if "lora_B" in name)   # it learned something

    def metrics(path: Path) -> list[dict]:
        return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert metrics(folder / "out" / "grpo") == metrics(Path(reference.adapter_dir))
    assert "eval_score" in metrics(folder / "out" / "grpo")[-1]
    assert {"rewards/shorter/mean", "rewards/sevens/mean"} <= set(metrics(folder / "out" / "grpo")[0])

    (folder / "jobs.yaml").write_text(yaml.safe_dump(jobs("rewards:shorter", "exact_match", "out")))
    with pytest.raises(SpecError) as refused:
        load_run_spec(folder / "jobs.yaml")
    message = str(refused.value)
    assert "jobs.yaml:" in message and "field grpo.reward: 'rewards:shorter': cannot import module 'rewards'" in message
    assert "(grpo.reward: rewards.py:shorter, relative to the jobs or sweep file)" in message, message
    text = yaml.safe_dump(jobs(["exact_match", "rewards:shorter"], "exact_match", "out"), default_flow_style=False)
    (folder / "jobs.yaml").write_text(text)
    with pytest.raises(SpecError) as refused:
        load_run_spec(folder / "jobs.yaml")
    line = next(n for n, row in enumerate(text.splitlines(), 1) if row.strip() == "- rewards:shorter")
    assert f"jobs.yaml:{line}: job 'grpo' (jobs[0]), field grpo.reward.1: 'rewards:shorter': cannot import" in str(
        refused.value), refused.value


def test_a_grpo_job_samples_among_the_tokens_its_top_p_and_min_p_keep():
    """grpo.top_p and grpo.min_p reach the job's sampling: a nucleus of the likeliest token alone (or min_p 1) makes
    each prompt's completions the greedy one, all alike, where the whole distribution draws different ones."""
    base = _number_base()

    def groups(**narrow) -> list[set[tuple[int, ...]]]:
        trainer = FusedTrainer(base)
        spec = _grpo_spec("grpo", "contains", grpo={"reward": "contains", "num_generations": 4, "max_new_tokens": 5,
                                                    "temperature": 1.0, **narrow})
        trainer.add_job(TrainingJob.create(spec, base, _prompt_rows(0, 4), [], seed=0))
        kept, failed = trainer.rollouts(trainer.compose())
        trainer.remove_job("grpo")
        assert not failed
        return [{c.input_ids for c in rollout.completions} for rollout in kept[0][1]]

    assert any(len(group) > 1 for group in groups())
    greedy = [len(group) for group in groups(top_p=1e-9)]
    assert greedy == [1] * len(greedy)
    assert groups(min_p=1.0) == groups(top_p=1e-9)


@pytest.mark.parametrize("mask", [False, True])
def test_completions_cut_at_max_new_tokens_are_told_and_masked_when_asked(monkeypatch, mask):
    """A completion that reached max_new_tokens without an EOS (or pad) at its end is truncated, as TRL tells it;
    with mask_truncated_completions its tokens are no targets (left out of the loss), the others train as
    before; the step reports the share cut (TRL's completions/clipped_ratio)."""
    import actors.engine.grpo as grpo

    base = _number_base()
    eos = base.tokenizer.eos_token_id
    sampled = [[30, 31, 32, 33, 34], [30, eos], [40, 41, 42, 43, eos], [50, 51, 0],   # cut, ended, ended, ended (pad)
               [60, 61, 62, 63, 64], [60, 61, 62, 63, 65], [eos], [70, 71, 72, 73, 74]]   # cut, cut, ended, cut
    monkeypatch.setattr(grpo, "greedy_generate_many", lambda *args, **kwargs: [list(t) for t in sampled])   # as drawn
    spec = _grpo_spec("grpo", "contains", grpo={"reward": "contains", "num_generations": 4, "max_new_tokens": 5,
                                                "mask_truncated_completions": mask})
    out = grpo.rollouts(base, "grpo", spec.grpo, _prompt_rows(0, 2), seed=0)
    cut = [True, False, False, False, True, True, False, True]
    assert [flag for rollout in out for flag in rollout.truncated] == cut
    for rollout, tokens in zip(out, (sampled[:4], sampled[4:]), strict=True):
        for completion, row, was_cut in zip(rollout.completions, tokens, rollout.truncated, strict=True):
            assert completion.input_ids[rollout.prompt_length:] == tuple(row)
            trained = completion.labels[rollout.prompt_length:]
            assert trained == ((IGNORE_INDEX,) * len(row) if mask and was_cut else tuple(row))
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, _prompt_rows(0, 2), [], seed=0)
    trainer.add_job(job)
    report = trainer.run_step([(job, out)])
    row = report.results[0].optimizer_step.as_row()   # the job's metrics.jsonl row of this optimizer step
    assert row["completions/clipped_ratio"] == pytest.approx(4 / 8)
    assert row["completions/mean_length"] == pytest.approx(sum(map(len, sampled)) / 8)
    kept = sum(len(row) for row, was_cut in zip(sampled, cut, strict=True) if not (mask and was_cut))
    assert report.results[0].targets == kept
    if mask:   # every completion cut: nothing to learn from (loss 0, no targets), and the step still says why
        sampled[:] = [[30, 31, 32, 33, 34]] * 8
        everything_cut = grpo.rollouts(base, "grpo", spec.grpo, _prompt_rows(0, 2), seed=0)
        result = trainer.run_step([(job, everything_cut)]).results[0]
        assert result.targets == 0 and result.loss == 0.0
        row = result.optimizer_step.as_row()
        assert row["completions/clipped_ratio"] == 1.0 and row["completions/mean_length"] == 5.0, row


def test_sampling_that_runs_out_of_memory_fails_its_job_alone(monkeypatch):
    """Sampling a GRPO job's completions runs out of memory: that job fails with the sizes to lower, the
    others' step goes on (nothing retries the same sampling forever)."""
    import actors.engine.grpo as grpo

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(grpo, "greedy_generate_many", out_of_memory)
    base = _number_base()
    trainer = FusedTrainer(base)
    trainer.add_job(TrainingJob.create(_grpo_spec("big", "contains"), base, _prompt_rows(0, 4), [], seed=0))
    good = JobSpec(name="good", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=2)
    trainer.add_job(TrainingJob.create(good, base, random_examples(1, count=4, vocab=VOCAB), [], seed=1))
    kept, failed = trainer.rollouts(trainer.compose())
    assert [job.name for job, _ in kept] == ["good"] and [job.name for job, _ in failed] == ["big"]
    message = str(failed[0][1])
    assert "sampling its 8 completions ran out of memory (CUDA out of memory" in message, message
    assert "lower batch_size, grpo.num_generations, max_seq_len or grpo.max_new_tokens" in message
    assert trainer.run_step(kept).results[0].job == "good"


@pytest.mark.parametrize(("rows", "prompt", "new"), [(4, 6, 3), (24, 40, 8), (12, 90, 30), (8, 600, 20)])
def test_sampling_bytes_bound_what_the_allocator_counts(rows, prompt, new):
    """The sampling estimate (KV cache, one layer's prompt pass, the logits) against torch's allocator
    count of the same sampling (the profiler's memory records on CPU): never below it, and not so far above
    that it would refuse what fits (within 3x: the prompt pass's transients are counted as if all were live
    at once)."""
    from actors.engine.generate import Sampling, greedy_generate_many
    from actors.engine.grpo import sampling_bytes
    from actors.engine.memory import measure_peak

    base = _number_base()
    prompts = [[(7 * i + j) % (VOCAB - 10) + 5 for j in range(prompt - i % 3)] for i in range(rows)]
    generator = torch.Generator().manual_seed(0)
    _, measured = measure_peak(lambda: greedy_generate_many(base, [(None, p) for p in prompts], new, set(),
                                                             Sampling(1.0, 0, generator)), base.device)
    estimate = sampling_bytes(base, rows, prompt + new)
    assert measured <= estimate <= 3 * measured, (measured, estimate)


def test_a_grpo_job_whose_sampling_cannot_fit_the_budget_is_refused_at_start(tiny_model_dirs, tmp_path):
    """A trainer whose memory budget leaves less than a GRPO job's largest rollout needs: the job assigned to
    it fails at start naming the sizes to lower (rather than running out of memory mid-run); an SFT job
    assigned with it completes."""
    from actors.engine.grpo import sampling_bytes
    from actors.engine.models import load_base_model
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.trainer.trainer_loop import TrainerLoop
    from tests.helpers.service import job_dict, run_spec, write_task_data
    from tests.helpers.trainer import assignment_for, run_until_idle

    model = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "arith")
    grpo = job_dict("grpo", data, 2, method="grpo", batch_size=4, max_seq_len=256,
                    grpo={"reward": "contains", "num_generations": 16, "max_new_tokens": 64})
    base = load_base_model(model, dtype="float32", device="cpu")
    weights = sum(t.numel() * t.element_size() for t in [*base.model.parameters(), *base.model.buffers()])
    budget = weights + sampling_bytes(base, 64, 320) // 2   # half of what the largest rollout needs
    submissions = run_spec(model, tmp_path / "out", [grpo, job_dict("sft", data, 2)], step_tokens=32768).submissions()
    loop = TrainerLoop(base, TrainerConfig(base_model=model, memory_budget_bytes=budget), "trainer-0", tmp_path / "s")
    try:
        for submission in submissions:
            loop.assign(assignment_for(submission, submission.job.name, base.tokenizer))
        events = run_until_idle(loop)
    finally:
        loop.close()
    ends = {e.job_id: e for e in events if e.kind in ("failed", "completed")}
    assert ends["grpo"].kind == "failed"
    reason = ends["grpo"].data["reason"]
    assert "could not start: sampling its completions (64 sequences of up to 320 tokens) needs some" in reason
    assert "lower batch_size, grpo.num_generations, max_seq_len or grpo.max_new_tokens" in reason
    assert ends["sft"].kind == "completed", ends["sft"]
