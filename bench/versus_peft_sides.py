"""The two sides of bench/versus_peft.py, each run in a fresh process of its own:

    python bench/versus_peft_sides.py aspen|peft PLAN.json

aspen: `train_locally` on the jobs spec (what `aspen run --in-process` runs). PEFT: a plain PEFT loop per job,
one job after another. This module imports nothing of aspen at its top: the PEFT process imports torch,
transformers and peft only, so that nothing aspen sets at import (MKL's reproducibility mode) reaches it. Each
side prints its result as its last stdout line: RESULT, then JSON."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULT = "RESULT "   # a side's last stdout line: this prefix, then its JSON


def aspen_side(plan: dict) -> dict:
    """`train_locally` (what `aspen run --in-process` runs) on the jobs spec; every step's end time, real
    tokens and loss per job."""
    import torch

    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec

    torch.set_num_threads(plan["threads"])
    spec = RunSpec.model_validate(plan["spec"])
    base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device, quantization=spec.quantization)
    loading_peak = kernel_peak_resident()   # the trainer's memory probe resets VmHWM: loading's peak kept here
    steps = []

    def on_step(report) -> None:
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        steps.append({"end": time.perf_counter(), "seconds": report.seconds, "padding": report.padding_tokens,
                      "jobs": {r.job: [r.tokens, r.loss] for r in report.results},
                      "reported_peak": report.resident_peak_bytes})

    summaries = train_locally(spec, base=base, progress=False, on_step=on_step)
    unfinished = [f"{s.name}: {s.state} ({s.reason})" for s in summaries if s.state != "completed"]
    if unfinished:
        raise RuntimeError(f"aspen side: jobs did not complete: {unfinished}")
    # the window opens once every job has made its first step
    seen: set[str] = set()
    first = None
    for index, step in enumerate(steps):
        seen |= set(step["jobs"])
        if len(seen) == len(spec.jobs):
            first = index
            break
    timed = steps[first + 1:]
    per_job: dict[str, list[list]] = {job.name: [] for job in spec.jobs}
    for step in steps:
        for name, value in step["jobs"].items():
            per_job[name].append(value)
    return {"threads": torch.get_num_threads(), "tokens": sum(t for s in timed for t, _ in s["jobs"].values()),
            "seconds": timed[-1]["end"] - steps[first]["end"], "step_seconds": sum(s["seconds"] for s in timed),
            "steps": len(steps), "timed_steps": len(timed),
            "jobs_per_step": statistics.mean(len(s["jobs"]) for s in steps),
            "padding_tokens": sum(s["padding"] for s in steps), "per_job": per_job,
            # the trainer resets VmHWM as each step begins (its report: the step's own peak), so the reading at the
            # end covers the last step only: the process's peak is the largest of loading's, the steps' and that
            "peak_resident_bytes": max(loading_peak, kernel_peak_resident(),
                                       *(s["reported_peak"] or 0 for s in steps)),
            "reported_peak_bytes": max((s["reported_peak"] or 0 for s in steps), default=0),
            "predicted_peak_bytes": predicted_resident_peak(Path(spec.output_dir)),
            "memory_rows": [{key: row.get(key) for key in ("step", "tokens", "peak_memory_bytes", "memory_measured",
                                                           "predicted_memory_bytes", "resident_peak_bytes",
                                                           "predicted_resident_bytes")}
                            for row in step_rows(Path(spec.output_dir))]}


def kernel_peak_resident() -> int:
    """This process's peak resident set as the kernel counts it (VmHWM; getrusage's maxrss elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def predicted_resident_peak(output_dir: Path) -> int | None:
    """The highest resident peak the trainer admitted a step by (its step log's `predicted_resident_bytes`:
    written before each step ran), or None without one (not a CPU, or no /proc)."""
    predicted = [row.get("predicted_resident_bytes") for row in step_rows(output_dir)]
    predicted = [p for p in predicted if p is not None]
    return max(predicted) if predicted else None


def step_rows(output_dir: Path) -> list[dict]:
    return [row for path in sorted(output_dir.rglob("trainer*.jsonl"))
            for row in map(json.loads, path.read_text().splitlines())]


def peft_side(plan: dict) -> dict:
    """A plain PEFT training loop per job, one job after another, on the model loaded by transformers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(plan["threads"])
    device = torch.device(plan["device"])
    kwargs = {"gguf_file": plan["gguf_file"]} if plan["gguf_file"] else {}
    model = AutoModelForCausalLM.from_pretrained(plan["model_path"], dtype=getattr(torch, plan["dtype"]),
                                                 local_files_only=plan["local_files_only"], **kwargs).to(device)

    def config(lora: dict) -> LoraConfig:
        return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                          target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def padded(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), longest), plan["pad_token_id"], dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        labels = torch.full((len(batch), longest), -100, dtype=torch.long)
        for row, (tokens, targets) in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
            labels[row, :len(tokens)] = torch.tensor(targets)
        return ids.to(device), mask.to(device), labels.to(device)

    seconds, tokens, padded_tokens, per_job = 0.0, 0, 0, {}
    with tempfile.TemporaryDirectory(prefix="peft-side-") as out:
        for job in plan["jobs"]:
            peft_model = get_peft_model(model, config(job["lora"]))
            peft_model.train()
            parameters = [p for p in peft_model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(parameters, lr=plan["lr"], weight_decay=0.0)
            per_job[job["name"]] = []
            started = None
            for index, batch in enumerate(job["batches"]):
                ids, mask, labels = padded(batch)
                loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, plan["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                real = sum(len(tokens) for tokens, _ in batch)
                per_job[job["name"]].append([real, float(loss.detach())])
                if index == 0:
                    sync()
                    started = time.perf_counter()
                else:
                    tokens += real
                    padded_tokens += ids.numel()
            peft_model.save_pretrained(Path(out) / job["name"])
            sync()
            seconds += time.perf_counter() - started
            model = peft_model.unload()   # the base without this job's adapter, for the next job
    return {"threads": torch.get_num_threads(), "tokens": tokens, "seconds": seconds, "padded_tokens": padded_tokens,
            "per_job": per_job, "peak_resident_bytes": kernel_peak_resident()}


if __name__ == "__main__":
    side, plan_path = sys.argv[1], Path(sys.argv[2])
    run = {"aspen": aspen_side, "peft": peft_side}[side]
    print(RESULT + json.dumps(run(json.loads(plan_path.read_text()))), flush=True)
