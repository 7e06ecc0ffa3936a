"""Memory: the trainer's predicted step peak against the allocator's measured one, predicted against measured
peak resident memory, what activation recomputation saves and costs, and admission under a tight budget.

    PYTHONPATH=. python bench/memory.py [--quick]

    PYTHONPATH=. python bench/memory.py --device cuda [--quick] [--json F]   # the GPU suite's part: the
        step peaks on CUDA, every case in one process, and recomputation (no resident set, malloc, admission)

1. Per configuration (dtype, NF4, job count, LoRA rank, dropout, step size, recomputation), in its own
   process: the memory model's prediction for a step, as the trainer makes it (the probe-measured prior,
   actors/engine/memory_prior.py, before any step of the jobs was seen), against the step's peak counted by
   the allocator (CUDA: max_memory_allocated; CPU: torch.profiler's memory events over the live tensors
   held before the step), and the predicted peak resident set (`memory_prior.predict_resident`, made before
   the jobs' first step) against the process's VmHWM over 8 steps no profiler watches (RESIDENT_STEPS).
2. glibc malloc's default (what a CPU trainer runs) vs its mmap threshold fixed at 64 KiB (what CPU
   trainers ran on 2026-11-25/26, so that the resident set followed the live tensors): step time and the
   process's peak resident set of the same steps, each setting in fresh processes of its own (mallopt is
   process-wide and a heap's state outlives a setting's change), alternated A-B-B-A.
3. Recomputation on vs off side by side in one process: the allocator peak and the step time of the same
   steps, alternated.
4. Admission: the in-process driver with a budget that the scheduler's admission estimate (the trainer's
   weights and a full step by its probe-measured estimate, plus each held job's adapter) has room for 2 of
   4 jobs at once: those 2 are admitted, the others wait for one to end, every step's peak is measured;
   it fails unless exactly 2 jobs were held at once, every job completed and no step exceeded the budget.
   Then the trainer's own per-step gate with no admission in front of it: all 4 jobs on one trainer loop
   under a budget 5% below the predicted peak of a step of all 4 (the composer fills it to ~95%): it fails
   where a step exceeds that budget or the steps stay as large as without it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from bench.memory_admission import admission, print_admission
from bench.memory_malloc import malloc_side_by_side, print_malloc

RESIDENT_STEPS = 8   # steps over which a configuration's peak resident set is measured
MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def one_configuration(case: dict, device: str = "cpu") -> dict:
    """Build, probe, steps of the case's jobs; predicted vs measured. On the CPU in a fresh process (the
    resident set is the process's); on CUDA one case after another in one process (the allocator's peak is
    reset for each), without the resident set (a host matter: the CPU run measures it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.data import Example
    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.job import TrainingJob
    from actors.engine.memory import (
        live_tensor_bytes,
        measure_peak,
        model_bytes,
        process_peak_resident_bytes,
        resident_bytes,
    )
    from actors.engine.memory_prior import StepMemoryPrior, predict_resident, probe_base_activation
    from actors.engine.models import from_module, quantize_linears
    from actors.engine.trainer import FusedTrainer
    from actors.spec.job_spec import JobSpec
    from policies.memory_model import MemoryModel, StepShape

    on_cpu = device == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model = model.to(dtype)
    if case["quantization"] == "nf4":
        quantize_linears(model, "nf4", dtype, torch.device(device))
    base = from_module(model.to(device), None)
    weights = model_bytes(model)
    shapes = {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features)
              for n in linear_module_names(model)}
    activation = probe_base_activation(base, recompute=case["recompute"])
    prior = StepMemoryPrior(base, activation, shapes, recompute=case["recompute"])
    memory = MemoryModel.for_model(weights + activation.constant, activation.per_token,
                                   bytes_per_adapter_parameter=activation.bytes_per_adapter_parameter)
    trainer = FusedTrainer(base, step_tokens=10**6, recompute=case["recompute"])
    length, rows = case["length"], case["tokens"] // case["jobs"] // case["length"]
    example = Example(tuple(range(3, 3 + length)),
                      tuple([-100] * (length // 3) + list(range(3 + length // 3, 3 + length))))
    for j in range(case["jobs"]):
        spec = JobSpec(name=f"j{j}", data="-", format={"type": "text"}, batch_size=rows, max_steps=RESIDENT_STEPS + 2,
                       warmup_steps=0, lora={"r": case["rank"], "dropout": case["dropout"],
                                             "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, [example] * (2 * rows), [], seed=j))
    # predicted before the jobs' first step, from the prior alone
    chosen = trainer.compose()
    parts = [(job.spec.lora, rows * length, batch) for job, batch in chosen]
    parameters = sum(p.numel() for job in trainer.jobs.values() for p in job.adapter.parameters())
    shape = StepShape.of([len(e) for _, b in chosen for e in b], parameters,
                         analytic_bytes=prior.analytic_bytes(parts))
    predicted = memory.predict(shape)
    optimizers = [job.optimizer.optimizer for job in trainer.jobs.values()]
    if not on_cpu:
        trainer.run_step(chosen)
        held = live_tensor_bytes(model, optimizers)
        _, growth = measure_peak(trainer.train_step, base.device)
        return {**case, "device": device, "predicted": predicted, "measured": held + growth}
    uncounted = prior.analytic_bytes(parts, resident=True) - prior.analytic_bytes(parts)
    resident_predicted = predict_resident(resident_bytes(), live_tensor_bytes(model, optimizers), predicted,
                                          uncounted, process_peak_resident_bytes())
    # the resident set measured over steps that no profiler watches (glibc's heap keeps freed pages for the next
    # steps to reuse: the peak may rise after the first)
    trainer.run_step(chosen)
    for _ in range(RESIDENT_STEPS - 1):
        trainer.train_step()
    resident_measured = process_peak_resident_bytes()
    # then the allocator's count of one more step (torch.profiler)
    held = live_tensor_bytes(model, optimizers)
    _, growth = measure_peak(trainer.train_step, base.device)
    return {**case, "device": device, "predicted": predicted, "measured": held + growth,
            "resident_predicted": resident_predicted, "resident_measured": resident_measured}


def recompute_side_by_side(steps: int, device: str = "cpu") -> list[dict]:
    """The same steps with recomputation off and on, alternated in one process: peak and seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.memory import measure_peak
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.spec.job_spec import JobSpec

    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(LlamaConfig(**MODEL)).to(device), None)
    length = 256
    example = Example(tuple(range(3, 3 + length)), tuple([-100] * 80 + list(range(83, 3 + length))))
    trainers = {}
    for mode in ("none", "layers"):
        trainer = FusedTrainer(base, step_tokens=10**6, recompute=mode)
        for j in range(2):
            spec = JobSpec(name=f"{mode}-{j}", data="-", format={"type": "text"}, batch_size=4,
                           max_steps=steps + 2, warmup_steps=0, lora={"r": 16, "target_modules": "all-linear"})
            trainer.add_job(TrainingJob.create(spec, base, [example] * 4, [], seed=j))
        trainer.train_step()
        trainers[mode] = trainer
    seconds = {mode: [] for mode in trainers}
    peaks = {}
    for _ in range(steps):
        for mode, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step()
            if device != "cpu":
                torch.cuda.synchronize()
            seconds[mode].append(time.perf_counter() - started)
    for mode, trainer in trainers.items():
        _, peaks[mode] = measure_peak(trainer.train_step, base.device)
    return [{"recompute": mode, "step_peak_bytes": peaks[mode], "median_step_s": statistics.median(seconds[mode]),
             "steps": steps} for mode in trainers]


CASES = [
    dict(dtype="float32", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=512, length=128, recompute="none"),
    dict(dtype="float32", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128, recompute="none"),
    dict(dtype="float32", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=2048, length=256, recompute="none"),
    dict(dtype="float32", quantization="none", jobs=4, rank=16, dropout=0.0, tokens=1024, length=128, recompute="none"),
    dict(dtype="float32", quantization="none", jobs=2, rank=64, dropout=0.0, tokens=1024, length=128, recompute="none"),
    dict(dtype="float32", quantization="none", jobs=2, rank=16, dropout=0.05, tokens=1024, length=128,
         recompute="none"),
    dict(dtype="float32", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128,
         recompute="layers"),
    dict(dtype="float32", quantization="none", jobs=4, rank=16, dropout=0.05, tokens=2048, length=256,
         recompute="layers"),
    dict(dtype="bfloat16", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128,
         recompute="none"),
    dict(dtype="bfloat16", quantization="none", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128,
         recompute="layers"),
    dict(dtype="bfloat16", quantization="nf4", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128, recompute="none"),
    dict(dtype="bfloat16", quantization="nf4", jobs=2, rank=16, dropout=0.0, tokens=1024, length=128,
         recompute="layers"),
]


def _row(case: dict) -> str:
    return (f"{case['dtype']:<8} {case['quantization']:<4} {case['recompute']:<6} {case['jobs']:>4} {case['rank']:>4} "
            f"{case['dropout']:>5} {case['tokens']:>6}")


def gpu_main(device: str, quick: bool, json_path: Path | None) -> None:
    """The memory model on the device (the GPU suite's `memory` part): every case one after another in this one
    process (the allocator's peak reset for each: no process start and import per case, which made the CPU form
    take 12 x ~9 s and run past the 75 s the lease gave it), then recomputation off and on. The resident set,
    glibc's malloc settings and admission are the CPU form's (host memory; admission needs smollm2's tokenizer)."""
    import gc

    from actors.engine.extras import MissingExtraError
    cases = CASES[::3] if quick else CASES
    results, skipped = [], []
    print(f"memory model on {device} (torch {torch.__version__}), model {MODEL}", flush=True)
    print("dtype    q    recomp jobs rank  drop tokens | predicted  measured  error", flush=True)
    for case in cases:
        try:
            row = one_configuration(case, device)
        except MissingExtraError as error:   # nf4 without bitsandbytes
            skipped.append(f"{_row(case)}: {error}")
            continue
        error = (row["predicted"] - row["measured"]) / row["measured"]
        results.append({**row, "error": error})
        print(f"{_row(row)} | {row['predicted'] / 2**20:8.1f}M {row['measured'] / 2**20:8.1f}M {error:+6.1%}",
              flush=True)
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    for line in skipped:
        print(f"skipped {line}", flush=True)
    errors = [abs(r["error"]) for r in results]
    if errors:
        print(f"step peak ({'CUDA allocator' if device.startswith('cuda') else 'CPU allocator'}): median |error| "
              f"{statistics.median(errors):.1%}, max {max(errors):.1%} over {len(errors)} cases", flush=True)
    off, on = recompute_side_by_side(3 if quick else 6, device)
    print(f"recompute off: step peak {off['step_peak_bytes'] / 2**20:.1f}M, median step {off['median_step_s']:.3f}s; "
          f"on: {on['step_peak_bytes'] / 2**20:.1f}M, {on['median_step_s']:.3f}s "
          f"(saves {1 - on['step_peak_bytes'] / off['step_peak_bytes']:.0%} of the step's allocations, "
          f"costs {on['median_step_s'] / off['median_step_s'] - 1:+.0%} time)", flush=True)
    print("not run here: the resident set, malloc settings and admission (the CPU form: bench/memory.py)")
    if json_path:
        json_path.write_text(json.dumps({"device": device, "cases": results, "skipped": skipped,
                                         "median_abs_error": statistics.median(errors) if errors else None,
                                         "max_abs_error": max(errors) if errors else None,
                                         "recompute": [off, on]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the step peaks against CUDA's allocator, every case in one process (the GPU "
                             "suite's part); cpu (default): also the resident set, malloc and admission")
    parser.add_argument("--allow-cpu", action="store_true", help="--device cuda's form on the CPU (a dry run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one_configuration(json.loads(args.case))))
        return
    if args.device == "cuda":
        if not torch.cuda.is_available() and not args.allow_cpu:
            raise SystemExit("--device cuda: no CUDA device here (--allow-cpu runs that form on the CPU)")
        gpu_main("cuda" if torch.cuda.is_available() else "cpu", args.quick, args.json)
        return
    cases = CASES[::3] if args.quick else CASES
    results = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    for case in cases:
        out = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                             env=env, check=False)
        if out.returncode != 0:
            raise SystemExit(f"case {case} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"torch {torch.__version__}, CPU, model {MODEL}")
    print("dtype    q    recomp jobs rank  drop tokens | predicted  measured  error | resident pred  meas  error")
    errors, resident_errors = [], []
    for r in results:
        error = (r["predicted"] - r["measured"]) / r["measured"]
        resident = (r["resident_predicted"] - r["resident_measured"]) / r["resident_measured"]
        errors.append(abs(error))
        resident_errors.append(abs(resident))
        print(f"{_row(r)} | {r['predicted'] / 2**20:8.1f}M {r['measured'] / 2**20:8.1f}M {error:+6.1%} | "
              f"{r['resident_predicted'] / 2**20:8.1f}M {r['resident_measured'] / 2**20:7.1f}M {resident:+6.1%}")
    print(f"step peak (allocator): median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}")
    print(f"peak resident (VmHWM): median |error| {statistics.median(resident_errors):.1%}, "
          f"max {max(resident_errors):.1%}")
    print_malloc(malloc_side_by_side(4 if args.quick else 8, env, MODEL))
    side = recompute_side_by_side(3 if args.quick else 6)
    off, on = side
    print(f"recompute off: step peak {off['step_peak_bytes'] / 2**20:.1f}M, median step {off['median_step_s']:.3f}s; "
          f"on: {on['step_peak_bytes'] / 2**20:.1f}M, {on['median_step_s']:.3f}s "
          f"(saves {1 - on['step_peak_bytes'] / off['step_peak_bytes']:.0%} of the step's allocations, "
          f"costs {on['median_step_s'] / off['median_step_s'] - 1:+.0%} time; {off['steps']} steps each, alternated)")
    print_admission(admission(args.quick, MODEL))


if __name__ == "__main__":
    main()
