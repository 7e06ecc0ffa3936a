"""Gradient accumulation against Hugging Face's Trainer (token-weighted since transformers 4.46: the loss of
an optimizer step is the sum of its target tokens' losses over their count, whatever micro-batch they
came in), and float16 dynamic loss scaling (per job, so that one job's overflow skips only its own step)."""

from __future__ import annotations

import math

import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.checkpoint.peft_io import WEIGHTS_NAME, adapter_state_dict, save_adapter
from actors.data import Example
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.optim import LossScale
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.accumulation import FixedOrder, pad_rows
from tests.helpers.models import random_examples, tiny_config
from tests.helpers.tolerances import adamw_first_step_bound, llama_chain_terms, rounding_tolerance

VOCAB = 300


class InOrderTrainer(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def _uneven_examples() -> list[Example]:
    """Micro-batches whose target counts differ by an order of magnitude: averaging micro-batch means would
    weigh a target token of a short micro-batch ~10x one of a long micro-batch."""
    short = random_examples(1, count=6, vocab=VOCAB, min_len=6, max_len=8, prompt_share=0.7)
    long = random_examples(2, count=6, vocab=VOCAB, min_len=40, max_len=48, prompt_share=0.1)
    return [short[0], short[1], long[0], long[1], short[2], long[2],
            long[3], long[4], short[3], short[4], long[5], short[5]]


class _StepCapture(TrainerCallback):
    """Hugging Face's Trainer: each optimizer step's gradient (as AdamW gets it: summed over the micro-batches,
    divided by the step's target tokens, clipped) and the adapter after the step, by aspen's parameter names."""

    def __init__(self, model):
        self.parameters = {name.removeprefix("base_model.model.").replace(".default", ""): parameter
                           for name, parameter in model.named_parameters() if "lora_" in name}
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.gradients.append({name: p.grad.detach().clone() for name, p in self.parameters.items()})

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.weights.append({name: p.detach().clone() for name, p in self.parameters.items()})


def _target_tokens(examples: list[Example]) -> int:
    """A causal LM's targets: every label but the first of each sequence that is not -100."""
    return sum(sum(1 for label in e.labels[1:] if label != -100) for e in examples)


def test_accumulation_weighs_tokens_as_hugging_face_trainer_does(tmp_path):
    """Two optimizer steps of three uneven micro-batches each, aspen and Hugging Face's Trainer from the same
    weights and adapter: the first step's gradient (every token weighing the same, whatever its micro-batch;
    the sum divided by the step's target tokens), its gradient norm and both steps' losses agree within the
    rounding tolerances of tests/helpers/tolerances.py (the same sums in other orders), and so do the weights after
    the first AdamW step, within the bound its update g/(|g|+eps) puts on each entry for gradients that differ
    by that tolerance. Not compared with one fixed tolerance: weights after AdamW steps (an entry whose
    gradient is near zero moves by up to lr·δ/eps for a rounding difference δ). A mean of the micro-batches'
    means instead of the tokens' mean moves the gradient by more than its largest entry here; an accumulation
    that does not start again at step 2 moves that step's loss by 4e-3, some 18 times its tolerance."""
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(tiny_config("llama", VOCAB)).eval()
    ours = LlamaForCausalLM(tiny_config("llama", VOCAB))
    ours.load_state_dict(hf_model.state_dict())
    base = from_module(ours, None)
    spec = JobSpec(name="acc", data="unused.jsonl", format={"type": "text"}, batch_size=2, grad_accum=3,
                   max_steps=2, lr=1e-2, lr_schedule="constant", weight_decay=0.0, max_grad_norm=1.0,
                   lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    examples = _uneven_examples()
    job = TrainingJob.attach(spec, base, FixedOrder(examples, spec.batch_size), [], total_steps=2, seed=0)
    save_adapter(job.adapter, tmp_path / "initial", "tiny")   # both start from the same adapter
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    parameters = dict(job.adapter.named_parameters())
    summed = {name: torch.zeros_like(p) for name, p in parameters.items()}   # step 1's backward passes, added

    def add_to(name: str):
        def hook(grad: torch.Tensor) -> None:   # returns nothing: the gradient itself is left as it is
            summed[name].add_(grad)
        return hook

    hooks = [p.register_hook(add_to(name)) for name, p in parameters.items()]
    losses, after_first = [], None
    while (report := trainer.train_step()) is not None:
        steps = [r.optimizer_step for r in report.results if r.optimizer_step is not None]
        losses += [step.loss for step in steps]
        if steps and after_first is None:
            after_first = {name: p.detach().clone() for name, p in parameters.items()}
            for hook in hooks:
                hook.remove()
    ours_after = adapter_state_dict(job.adapter)

    peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "initial", is_trainable=True)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, max_steps=2, learning_rate=1e-2,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                             remove_unused_columns=False, dataloader_num_workers=0)
    rows = [{"input_ids": list(e.input_ids), "labels": list(e.labels)} for e in examples]
    capture = _StepCapture(peft_model)
    hf = InOrderTrainer(model=peft_model, args=args, train_dataset=rows, data_collator=pad_rows, callbacks=[capture])
    hf.train()
    hf_after = {key.replace(".default", ""): value.detach() for key, value in peft_model.state_dict().items()
                if "lora_" in key}
    logged = [row for row in hf.state.log_history if "loss" in row]
    assert set(hf_after) == set(ours_after) and len(capture.gradients) == 2 == len(logged)
    initial = load_file(str(tmp_path / "initial" / WEIGHTS_NAME))
    moved = max(float((hf_after[k] - initial[k]).abs().max()) for k in hf_after if "lora_B" in k)
    assert moved > 1e-3, "the adapters did not move: nothing was compared"

    # step 1's gradient: aspen backpropagates each token's loss with weight 1 and divides the sum by the step's
    # target tokens; below the clipping threshold (norm < 1), which both then leave alone
    norm = job.history[0].grad_norm
    assert norm < spec.max_grad_norm
    gradient = {name: total / _target_tokens(examples[:6]) for name, total in summed.items()}
    largest = max(float(g.abs().max()) for g in capture.gradients[0].values())
    longest = max(len(e) for e in examples)
    terms = llama_chain_terms(base.model.config, sequence=longest, tokens=sum(len(e) for e in examples[:6]))
    delta = rounding_tolerance(terms, largest)
    print(f"step 1: largest gradient entry {largest:.2e}, tolerance {delta:.2e}")
    for name, expected in capture.gradients[0].items():
        assert float((gradient[name] - expected).abs().max()) <= delta, name
    # its norm: within the entries' tolerance times the square root of their count
    count = sum(g.numel() for g in gradient.values())
    assert abs(norm - logged[0]["grad_norm"]) <= delta * math.sqrt(count)
    # the weights after the first AdamW step: per entry, lr·δ·eps/(|g|-δ+eps)^2 (tests/helpers/tolerances.py)
    for name, expected in capture.weights[0].items():
        bound = adamw_first_step_bound(capture.gradients[0][name], delta, spec.lr, expected)
        assert bool(((after_first[name] - expected).abs().double() <= bound).all()), name

    # the losses: token-weighted means of same-sign terms, each token's terms (its logit and the log-sum-exp)
    # taken as twice its loss; step 2's also moves with the weights' difference after step 1, to first order
    # by the sum over entries of |step 2's gradient| times that difference
    loss_terms = llama_chain_terms(base.model.config, sequence=longest, tokens=longest, backward=False)
    assert abs(losses[0] - logged[0]["loss"]) <= rounding_tolerance(loss_terms, 2 * logged[0]["loss"])
    drift = sum(float((capture.gradients[1][name].double() * (after_first[name] - weights).double()).abs().sum())
                for name, weights in capture.weights[0].items())
    assert abs(losses[1] - logged[1]["loss"]) <= rounding_tolerance(loss_terms, 2 * logged[1]["loss"]) + drift


def test_loss_scale_backs_off_on_overflow_and_grows_after_clean_steps():
    scale = LossScale()
    scale.update(finite=False)
    assert scale.scale == LossScale.INITIAL / 2 and scale.skipped_steps == 1
    for _ in range(LossScale.GROWTH_INTERVAL):
        scale.update(finite=True)
    assert scale.scale == LossScale.INITIAL


def test_float16_overflow_skips_only_that_jobs_step():
    """On a float16 base each job has its own loss scale: an absurd scale overflows one job's float16
    activation gradients, that job's step is skipped (its adapter unchanged, its scale halved), and the other
    job's adapter equals the one it gets when trained alone."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", VOCAB)).to(torch.float16)
    base = from_module(model, None)

    def spec(name: str) -> JobSpec:
        return JobSpec(name=name, data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=1, lr=1e-2,
                       lr_schedule="constant", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})

    def run(names: list[str], blow_up: str | None) -> dict[str, tuple[TrainingJob, dict[str, torch.Tensor]]]:
        trainer = FusedTrainer(base)
        jobs = {}
        for name in names:
            seed = ord(name)
            job = TrainingJob.create(spec(name), base, random_examples(seed, count=2, vocab=VOCAB), [], seed=seed)
            assert job.optimizer.loss_scale is not None, "a float16 base scales its jobs' losses"
            if name == blow_up:
                job.optimizer.loss_scale.scale = 2.0**24   # float16 tops out at 65504
            trainer.add_job(job)
            jobs[name] = job
        while trainer.train_step() is not None:
            pass
        out = {name: (job, {k: v.detach().clone() for k, v in job.adapter.named_parameters()})
               for name, job in jobs.items()}
        for name in names:
            trainer.remove_job(name)
        return out

    fused = run(["a", "b"], blow_up="a")
    alone = run(["b"], blow_up=None)
    job_a, weights_a = fused["a"]
    assert all(float(v.abs().max()) == 0.0 for k, v in weights_a.items() if "lora_B" in k), \
        "a's overflowed step was skipped: its adapter is as it started"
    assert job_a.history[-1].grad_norm == float("inf")
    assert job_a.optimizer.loss_scale.scale == 2.0**23
    job_b, b_fused = fused["b"]
    assert job_b.optimizer.loss_scale.skipped_steps == 0
    b_alone = alone["b"][1]
    assert any(float(v.abs().max()) > 0 for k, v in b_fused.items() if "lora_B" in k)
    for key in b_alone:
        assert torch.equal(b_fused[key], b_alone[key]), key


def test_a_float16_jobs_loss_scale_survives_its_checkpoint(tmp_path):
    def half_base():
        torch.manual_seed(0)
        return from_module(LlamaForCausalLM(tiny_config("llama", VOCAB)).to(torch.float16), None)

    base = half_base()
    spec = JobSpec(name="half", data="unused.jsonl", format={"type": "text"}, batch_size=2, max_steps=3,
                   lora={"r": 4, "target_modules": ["q_proj"]})
    job = TrainingJob.create(spec, base, random_examples(5, count=4, vocab=VOCAB), [], seed=5)
    job.optimizer.loss_scale.scale, job.optimizer.loss_scale.clean_steps = 2.0**7, 11
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    resumed = TrainingJob.create(spec, half_base(), random_examples(5, count=4, vocab=VOCAB), [], seed=5)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert (resumed.optimizer.loss_scale.scale, resumed.optimizer.loss_scale.clean_steps) == (2.0**7, 11)
