"""Part 4 of bench/memory.py: admission under a tight budget. The in-process driver with a budget that the
scheduler's admission estimate (the trainer's weights and a full step by its probe-measured estimate, plus each
held job's adapter) has room for 2 of 4 jobs at once: those 2 are admitted, the others wait for one to end,
every step's peak is measured. Then the trainer's own per-step gate with no admission in front of it: all 4 jobs
on one trainer loop under a budget 5% below the predicted peak of a step of all 4."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch

ADMITTED = 2   # jobs the admission bench's budget has room for at once (of its 4)


def admission_estimate(spec, base) -> tuple[int, list[int]]:
    """What the scheduler counts when it admits jobs to a trainer of `spec`'s run (moved_jobs.no_room):
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


def admission(quick: bool, model: dict) -> dict:
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
        LlamaForCausalLM(LlamaConfig(**{**model, "vocab_size": 49152})).save_pretrained(folder / "model")
        smollm2_tokenizer().save_pretrained(folder / "model")   # the real tokenizer (49152 tokens)
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


def smollm2_tokenizer():
    """SmolLM2's tokenizer (49152 tokens), from the embedded base's converted folder (built once)."""
    from actors.storage.gguf_cache import converted_source
    from actors.storage.sources import load_tokenizer, resolve_source

    return load_tokenizer(converted_source(resolve_source("smollm2-135m")))


def print_admission(result: dict) -> None:
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
