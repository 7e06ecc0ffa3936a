#!/usr/bin/env python
"""The GPU suite's part `pipeline`: a 2-stage pipeline trainer on CUDA trains 4 jobs (dropout, accumulation,
clipping among them) beside the single-device trainer on the same base; the adapters must agree within
bfloat16's reach and every job must have trained. With two GPUs the stages are on cuda:0 and cuda:1 and talk
by NCCL; with one, both stages are on cuda:0 and their tensors pass by CUDA IPC (transport "shared": NCCL
puts one rank per device).

On CUDA the two are not bit for bit alike (cuBLAS picks its kernels by the number of rows, so the fused
stream's sums are ordered differently: tests/unit/engine/test_isolation.py). The check runs in float32 (TF32
off, PyTorch's default for matrix products) over each job's first optimizer step (5 micro-batches: one job
accumulates 2, one clips at 0.1, one has dropout), where the difference has a derived bound per adapter entry
(tests/helpers/tolerances.py): a gradient entry's two computations differ by at most δ = rounding_tolerance(n,
|g|max) (n the terms summed along the longest chain from a token to a LoRA weight's gradient; |g|max at most
the job's clipped gradient norm, from its step record), and AdamW's first update lr·g/(|g|+ε) then moves an
entry by at most `adamw_first_step_bound` (up to 2·lr where |g| <= δ, near zero far from it), |g| recovered
from the single-device update itself. A pipeline that loses a micro-batch, replays a dropout mask wrongly or
drops a gradient breaks the bound on many entries. After more steps (--steps N) AdamW's near-zero entries
(|g| <= δ flip ±lr) compound: on a CPU, one ulp of noise on the weights moved 4-step adapters by up to 1.3e-3
of their update; that figure is printed, not judged; so is bfloat16 (--dtype bfloat16, 0.088 on an H200,
2026-11-28), where the rounding bound does not apply at this size (n·u >= 0.5).

    python bench/pipeline_check.py [--layers 8] [--hidden 512] [--dtype float32|bfloat16] [--steps 1]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch


def cuda_base(layers: int, hidden: int, device: str = "cuda:0", dtype: str = "bfloat16"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.models import from_module
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    return from_module(model.to(device), None)


MAX_LENGTH, BATCH, MAX_ACCUMULATION = 256, 4, 2   # what jobs() makes


def chain_terms(layers: int, hidden: int) -> int:
    from transformers import LlamaConfig

    from tests.helpers.tolerances import llama_chain_terms
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64)
    return llama_chain_terms(config, sequence=MAX_LENGTH, tokens=BATCH * MAX_LENGTH * MAX_ACCUMULATION)


def first_step_violations(job, initial: dict, reference: dict, piped: dict, terms: int) -> tuple[int, int, float]:
    """Entries of a job's adapter outside the first-step bound (see the docstring), entries compared, and the
    largest |difference| / bound."""
    from tests.helpers.tolerances import ADAMW_EPS, adamw_first_step_bound, rounding_tolerance
    record = job.history[0]
    clip = job.spec.max_grad_norm
    delta = rounding_tolerance(terms, min(record.grad_norm, clip) if clip else record.grad_norm)
    lr = record.lr
    bad, total, worst = 0, 0, 0.0
    for name, weight in reference.items():
        update = (weight - initial[name]).double()
        ratio = (update.abs() / lr).clamp(max=1.0)
        # |g| from lr·g/(|g|+ε); where the update rounds to lr, |g| is beyond recovery: far from zero
        gradient = torch.where(ratio < 1 - 1e-6, ADAMW_EPS * ratio / (1 - ratio), torch.full_like(ratio, 1e30))
        bound = adamw_first_step_bound(gradient, delta, lr, weight)
        difference = (piped[name].double().to(weight.device) - weight.double()).abs()
        bad += int((difference > bound).sum())
        total += difference.numel()
        worst = max(worst, float((difference / bound).max()))
    return bad, total, worst


def jobs(steps: int = 1):
    from actors.data import Example
    from actors.spec.job_spec import JobSpec
    out = []
    for index, extra in enumerate([{}, {"grad_accum": 2}, {"max_grad_norm": 0.1}, {}]):
        generator = torch.Generator().manual_seed(index)
        examples = []
        for _ in range(24):
            length = int(torch.randint(32, MAX_LENGTH + 1, (1,), generator=generator))
            ids = torch.randint(3, 8192, (length,), generator=generator).tolist()
            examples.append(Example(tuple(ids), tuple([-100] * (length // 3) + ids[length // 3:])))
        lora = {"r": 8, "alpha": 16, "target_modules": "all-linear", "dropout": 0.1 if index == 3 else 0.0}
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=BATCH,
                       max_steps=steps, lr=1e-3, lora=lora, **extra)
        out.append((spec, examples, index))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32 (default): judged against a derived bound; bfloat16: the figure alone")
    parser.add_argument("--steps", type=int, default=1,
                        help="optimizer steps a job (1: judged per entry; more: the figure alone)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, both stages on the CPU (a dry run of this script, not a CUDA check)")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        two = torch.cuda.device_count() >= 2
        devices, transport = (["cuda:0", "cuda:1"], "distributed") if two else (["cuda:0", "cuda:0"], "shared")
    elif args.allow_cpu:
        devices, transport = ["cpu", "cpu"], "shared"
    else:
        print("no CUDA device: this part checks a pipeline trainer's stages on CUDA (--allow-cpu: a dry run on the "
              "CPU)", file=sys.stderr)
        return 2
    from actors.engine.job import TrainingJob
    from actors.engine.trainer import FusedTrainer
    from actors.service.pipeline.pipeline_processes import LocalPipeline
    base = cuda_base(args.layers, args.hidden, devices[0], args.dtype)
    trainer = FusedTrainer(base, step_tokens=1 << 15)
    created = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs(args.steps)]
    initial = {job.name: {k: v.detach().float().clone() for k, v in job.adapter.named_parameters()} for job in created}
    for job in created:
        trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    reference = {job.name: {k: v.detach().float() for k, v in job.adapter.named_parameters()} for job in created}
    started = time.perf_counter()
    loader = functools.partial(cuda_base, args.layers, args.hidden, "cpu", args.dtype)
    with LocalPipeline(loader, 2, split="even", devices=devices, step_tokens=1 << 15, transport=transport) as pipeline:
        for spec, examples, seed in jobs(args.steps):
            pipeline.add_job(spec, examples, seed=seed)
        reports = pipeline.run()
        states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in jobs(args.steps)}
        stats = pipeline.stats()
    print(f"pipeline on {devices} ({transport}): {len(reports)} micro-batches in {time.perf_counter() - started:.1f}s; "
          f"bubble shares "
          f"{[round(s['bubble_share'], 3) for s in stats]}")
    worst, judged = 0.0, args.dtype == "float32" and args.steps == 1
    terms = chain_terms(args.layers, args.hidden)
    failed = []
    for job in created:
        weights = reference[job.name]
        update = sum(float((w - initial[job.name][k]).norm() ** 2) for k, w in weights.items()) ** 0.5
        piped = {k: v.float() for k, v in states[job.name]["tensors"].items()}
        gap = sum(float((piped[k].to(w.device) - w).norm() ** 2) for k, w in weights.items()) ** 0.5
        if update == 0:
            failed.append(f"{job.name} did not train")
            continue
        worst = max(worst, gap / update)
        line = f"{job.name}: |pipeline - single| / |update| = {gap / update:.2e}"
        if judged:
            bad, total, ratio = first_step_violations(job, initial[job.name], weights, piped, terms)
            line += f"; {bad} of {total} entries outside their first-step bound (largest difference/bound {ratio:.2g})"
            if bad:
                failed.append(f"{job.name}: {bad} entries outside their bound")
        print(line)
    if not judged:
        print(f"worst {worst:.2e} ({args.dtype}, {args.steps} steps: not judged; see the docstring)")
        return 1 if failed else 0
    print(f"worst {worst:.2e} of the update; {'; '.join(failed) if failed else 'every entry within its derived bound'}")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
