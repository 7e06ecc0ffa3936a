"""Policies driving real runs on the local Ray: a higher-priority job preempts a running one, which
resumes from its checkpoint later with nothing lost (its adapter equals an uninterrupted run's), and a
third-party policy found by its entry point drives a run (its limit of two jobs per trainer holds in
every fused step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actors.engine.models import load_base_model
from actors.service.scheduler.config import ServiceConfig, TrainerConfig
from actors.service.scheduler.local_run import train_locally
from orchestrator.client import Client
from tests.helpers.service import (
    adapter_tensors,
    job_dict,
    max_relative_difference,
    run_spec,
    wait_for,
    write_task_data,
)


def step_rows(state_dir: Path) -> list[dict]:
    path = state_dir / "trainers" / "trainer-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


LOW_STEPS = 1000


@pytest.mark.long   # 60-90 s on CI's machine: two jobs of 1,000 steps, one preempted and resumed, and its solo run
def test_a_higher_priority_job_preempts_and_the_preempted_job_loses_nothing(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    config = ServiceConfig(state_dir=tmp_path / "state", policy="priority", tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1, max_jobs=2)])
    # The urgent job arrives once both have trained 2 steps and preempts one within a scheduler tick or two,
    # where the scheduler gets the CPU: it runs at nice 10 (actors/niceness.py) and on 2 cores busy with
    # other tests it may wait seconds while the trainer's steps (~0.05 s each) go on; a low job that ended
    # first would leave a free place and nobody to preempt. 1,000 steps leave it 30 s or more (at Ray's
    # default nice 15, which this suite's cluster had until 2026-11-30, it once fell 17 s behind and lost the
    # race; beside two busy processes it preempts within 0.5-3 s, but on 2026-12-04, beside the suite's other
    # worker, 400 steps ended 13 s after step 2 with no preemption yet); the rest is what the victim and its
    # solo reference train.
    low = [job_dict(f"low{i}", write_task_data(data, f"low{i}", offset=i), LOW_STEPS, checkpoint_every=1000)
           for i in range(2)]
    client = Client.local(config)
    try:
        first, second = client.submit_run(run_spec(base, tmp_path / "out", low, step_tokens=512))
        wait_for(lambda: client.status(first.id).step >= 2 and client.status(second.id).step >= 2,
                 what="both low-priority jobs to train")
        urgent = client.submit(job_dict("urgent", write_task_data(data, "urgent"), 10, priority=5), base_model=base)
        assert urgent.wait(timeout=120).state == "completed"
        victims = [h for h in (first, second)
                   if any(reason.startswith("preempted") for _, _, reason in client.transitions(h.id))]
        assert len(victims) == 1, {h.name: client.transitions(h.id) for h in (first, second, urgent)}
        victim = victims[0]
        # the other low job has shown what it had to (it kept its place); cancelled, it leaves the victim's
        # remaining steps alone on the trainer (on a CPU a fused step's time grows with its tokens)
        survivor = second if victim is first else first
        try:
            client.cancel(survivor.id)
        except ValueError as error:   # it may have trained its last step meanwhile (a slow scheduler round)
            assert "has already ended (completed" in str(error), error
        assert survivor.wait(timeout=120).state in ("cancelled", "completed")
        assert victim.wait(timeout=300).state == "completed"
        reasons = [reason for _, _, reason in client.transitions(victim.id)]
        assert any("resumed from step" in r for r in reasons), reasons
        assert [r["step"] for r in victim.losses()] == list(range(1, LOW_STEPS + 1))
        rows = step_rows(tmp_path / "state")
        assert max(len(r["jobs"]) for r in rows) == 2
    finally:
        client.shutdown()
    name = victim.name
    solo = run_spec(base, tmp_path / "solo", [next(j for j in low if j["name"] == name)], step_tokens=512)
    train_locally(solo, base=load_base_model(base, dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out" / name),
                                         adapter_tensors(tmp_path / "solo" / name))
    assert difference <= 1e-4, difference


def test_a_policy_found_by_entry_point_drives_a_run(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    config = ServiceConfig(state_dir=tmp_path / "state", policy="fixed-concurrency", tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1)])
    spec = run_spec(base, tmp_path / "out", [job_dict(f"j{i}", write_task_data(data, f"j{i}"), 15) for i in range(3)],
                    step_tokens=512)
    client = Client.local(config)
    try:
        assert client.info()["policy"] == "fixed-concurrency"
        handles = client.submit_run(spec)
        records = client.wait_all([h.id for h in handles], timeout=180)
        assert all(r.state == "completed" for r in records)
        ids = [h.id for h in handles]
    finally:
        client.shutdown()
    rows = step_rows(tmp_path / "state")
    assert max(len(r["jobs"]) for r in rows) == 2                  # the plug-in's limit held
    assert {j for r in rows for j in r["jobs"]} == set(ids)


@pytest.mark.long   # 46 s on CI's machine of 2026-12-04: jobs trained to their end under a memory budget
def test_a_memory_budget_that_fits_two_jobs_never_runs_three(ray_session, tiny_tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.lora_targets import adapted_shapes
    from actors.service.trainer.trainer_loop import TrainerLoop
    from policies.adapter_memory import adapter_memory_bytes
    from tests.helpers.models import tiny_config

    # A tiny Llama four times as wide as the shared one, so that an adapter (r=1024 on every linear layer:
    # 184 MB with its gradients and AdamW state) is large against the difference between the trainer's
    # first, cautious memory estimate and its model fitted to measured peaks (~40 MB here: the first
    # estimate assumes a logits chunk over every token of the step). The budget below then fits two jobs
    # and not three by either estimate, and by measurement. The third job waits for memory and then runs: once
    # (before the scheduler's view of the trainer kept the probe's estimate) the resident scale the two jobs'
    # steps taught filled the whole budget, and the third was failed as one that could never fit.
    torch.manual_seed(0)
    base = str(tmp_path / "wide-llama")
    wide = {k: v for k, v in tiny_config("llama").to_dict().items() if k != "head_dim"}
    LlamaForCausalLM(LlamaConfig(**{**wide, "hidden_size": 256, "intermediate_size": 1024})).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    lora = {"r": 1024, "alpha": 16, "target_modules": "all-linear"}
    trainer = TrainerConfig(base_model=base, step_tokens=128, num_cpus=0.5, threads=1)
    # the trainer's own first estimate of its fixed and per-step memory (before any step is measured), as the
    # scheduler sees it: from a trainer actor of this kind (on a CPU the estimate is its process's resident set,
    # whose runtime a test process would not share)
    probe = TrainerLoop(load_base_model(base, dtype="float32", device="cpu"), trainer, "probe", tmp_path / "probe")
    job_bytes = adapter_memory_bytes(lora["r"], adapted_shapes(lora["target_modules"], probe.status().linear_shapes))
    first = Client.local(ServiceConfig(state_dir=tmp_path / "first", tick_seconds=0.1, trainers=[trainer]))
    try:
        seen = wait_for(lambda: [t for t in first.trainers() if t["ready"]], what="a trainer ready")[0]
    finally:
        first.shutdown()
    budget = int(seen["memory_fixed_bytes"] + seen["memory_step_bytes"] + 2.5 * job_bytes)
    config = ServiceConfig(state_dir=tmp_path / "state", policy="fifo", tick_seconds=0.1,
                           trainers=[trainer.model_copy(update={"memory_budget_bytes": budget})])
    data = tmp_path / "data"
    jobs = [job_dict(f"m{i}", write_task_data(data, f"m{i}", offset=i), 30, lora=lora, batch_size=2, max_seq_len=32)
            for i in range(3)]
    client = Client.local(config)
    try:
        handles = client.submit_run(run_spec(base, tmp_path / "out", jobs, step_tokens=128))
        waiting = wait_for(lambda: [h for h in handles if "waiting for memory" in client.status(h.id).reason],
                           what="a job waiting for memory")
        records = client.wait_all([h.id for h in handles], timeout=240)
    finally:
        client.shutdown()
    assert all(r.state == "completed" for r in records), [(r.name, r.state, r.reason) for r in records]
    rows = step_rows(tmp_path / "state")
    assert max(len(r["jobs"]) for r in rows) == 2
    assert all(r["peak_memory_bytes"] <= budget and r["predicted_memory_bytes"] <= budget for r in rows)
    late = waiting[0].id
    first_late_step = min(i for i, r in enumerate(rows) if late in r["jobs"])
    ended_before = {j for r in rows[:first_late_step] for j in r["jobs"]} - set(rows[first_late_step]["jobs"])
    assert ended_before, "the third job started before either of the others had finished"


def test_a_node_runs_at_most_its_job_processes_and_the_rest_wait_without_one(ray_session, tiny_model_dirs, tmp_path):
    """job_processes_per_node: 2 on the one node: of four short jobs submitted at once, never more than two
    are running (the job table's own history) or share a step (the trainer's step log); the others wait queued,
    saying why, and every one completes."""
    base = str(tiny_model_dirs["llama"])
    config = ServiceConfig(state_dir=tmp_path / "state", tick_seconds=0.1, job_processes_per_node=2,
                           trainers=[TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1)])
    jobs = [job_dict(f"h{i}", write_task_data(tmp_path / "data", f"h{i}", offset=i), 4) for i in range(4)]
    client = Client.local(config)
    try:
        handles = client.submit_run(run_spec(base, tmp_path / "out", jobs, step_tokens=512))
        waiting = wait_for(lambda: [h for h in handles if "waiting for host memory" in client.status(h.id).reason],
                           what="a job waiting for host memory")
        assert "job_processes_per_node" in client.status(waiting[0].id).reason
        records = client.wait_all([h.id for h in handles], timeout=240)
        _, history = client.transitions_after(0, 10_000)
    finally:
        client.shutdown()
    assert all(r.state == "completed" for r in records), [(r.name, r.state, r.reason) for r in records]
    running, most = set(), 0
    for row in history:                      # every state change of every job, in order
        (running.add if row["state"] == "running" else running.discard)(row["job"])
        most = max(most, len(running))
    assert most == 2, history
    assert max(len(r["jobs"]) for r in step_rows(tmp_path / "state")) == 2


def test_two_cpu_trainers_on_one_node_plan_for_half_its_ram_between_them(ray_session, tiny_model_dirs, tmp_path):
    """Two trainer actors on the one node: each reports a default budget of a quarter of the RAM (each alone would
    plan for half of it: together they would overcommit the node)."""
    import os

    base = str(tiny_model_dirs["llama"])
    config = ServiceConfig(state_dir=tmp_path / "state", tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1, count=2)])
    client = Client.local(config)
    try:
        ready = wait_for(lambda: len(found := [t for t in client.trainers() if t["ready"]]) == 2 and found,
                         what="two trainers ready")
    finally:
        client.shutdown()
    quarter = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.5 * 0.5)
    assert [t["memory_budget_bytes"] for t in ready] == [quarter, quarter]
    assert len({t["node_id"] for t in ready}) == 1
