#!/usr/bin/env python
"""The GPU suite's part `pipeline`: a 2-stage pipeline trainer on CUDA trains 4 jobs (dropout, accumulation,
clipping among them) beside the single-device trainer on the same base; the adapters must agree within
bfloat16's reach and every job must have trained. With two GPUs the stages are on cuda:0 and cuda:1 and talk
by NCCL; with one, both stages are on cuda:0 and their tensors pass by CUDA IPC (transport "shared": NCCL
puts one rank per device).

On CUDA the two are not bit for bit alike (cuBLAS picks its kernels by the number of rows, so the fused
stream's sums are ordered differently: tests/unit/engine/test_isolation.py); the bound here is relative:
each job's adapter differs from the single-device one by at most 5% of its own update (the updates of a
few AdamW steps in bfloat16 forward passes).

    python bench/pipeline_check.py [--layers 8] [--hidden 512]
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


def cuda_base(layers: int, hidden: int, device: str = "cuda:0"):
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.models import from_module
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    return from_module(model.to(device), None)


def jobs():
    from actors.engine.data import Example
    from actors.engine.spec import JobSpec
    out = []
    for index, extra in enumerate([{}, {"grad_accum": 2}, {"max_grad_norm": 0.1}, {}]):
        generator = torch.Generator().manual_seed(index)
        examples = []
        for _ in range(24):
            length = int(torch.randint(32, 257, (1,), generator=generator))
            ids = torch.randint(3, 8192, (length,), generator=generator).tolist()
            examples.append(Example(tuple(ids), tuple([-100] * (length // 3) + ids[length // 3:])))
        lora = {"r": 8, "alpha": 16, "target_modules": "all-linear", "dropout": 0.1 if index == 3 else 0.0}
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=4, max_steps=4,
                       lr=1e-3, lora=lora, **extra)
        out.append((spec, examples, index))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
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
    from actors.service.pipeline_processes import LocalPipeline
    base = cuda_base(args.layers, args.hidden, devices[0])
    trainer = FusedTrainer(base, step_tokens=1 << 15)
    created = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs()]
    initial = {job.name: {k: v.detach().float().clone() for k, v in job.adapter.named_parameters()} for job in created}
    for job in created:
        trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    reference = {job.name: {k: v.detach().float() for k, v in job.adapter.named_parameters()} for job in created}
    started = time.perf_counter()
    loader = functools.partial(cuda_base, args.layers, args.hidden, "cpu")
    with LocalPipeline(loader, 2, split="even", devices=devices, step_tokens=1 << 15, transport=transport) as pipeline:
        for spec, examples, seed in jobs():
            pipeline.add_job(spec, examples, seed=seed)
        reports = pipeline.run()
        states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in jobs()}
        stats = pipeline.stats()
    print(f"pipeline on {devices} ({transport}): {len(reports)} micro-batches in {time.perf_counter() - started:.1f}s; "
          f"bubble shares "
          f"{[round(s['bubble_share'], 3) for s in stats]}")
    worst = 0.0
    for name, weights in reference.items():
        update = sum(float((w - initial[name][k]).norm() ** 2) for k, w in weights.items()) ** 0.5
        tensors = states[name]["tensors"]
        gap = sum(float((tensors[k].float().to(w.device) - w).norm() ** 2) for k, w in weights.items()) ** 0.5
        assert update > 0, f"{name} did not train"
        worst = max(worst, gap / update)
        print(f"{name}: |pipeline - single| / |update| = {gap / update:.4f}")
    print(f"worst {worst:.4f} (bound 0.05)")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
