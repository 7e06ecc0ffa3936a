"""Early stop in whole runs on a tiny random model, in-process (the service's scheduler core, trainer
loop, job data and stop rule): a job that has memorised its one repeated example stops long before its
budget, and a job paused and resumed stops at the same step as one never paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.engine.models import load_base_model
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.scheduler.local_run import train_locally
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import LateVerdicts, run_until_idle

ROW = {"question": "what is 17 and 25", "answer": "42, said the tiny model"}


def one_example(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "one.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


def memorising_job(data: Path, **extra) -> dict:
    """One example, repeated every step (batch 1, a 300-step budget), learnt fast by an all-linear adapter."""
    return job_dict("one", data, 300, batch_size=1, lr=1e-2, checkpoint_every=1000,
                    lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}, **extra)


def test_a_memorised_repeated_example_stops_early(tmp_path, memorising_model):
    """`early_stop: {min_improvement: 0.01}` as a new user writes it: the loss falls from ~16 to ~1e-3
    within 20 steps and then only creeps (still > 1% better in relative terms); the job stops before step
    100 of its 300 steps, by the absolute `min_delta` (0.1% of its first loss)."""
    base = load_base_model(str(memorising_model), dtype="float32", device="cpu")
    job = memorising_job(one_example(tmp_path / "data"), early_stop={"min_improvement": 0.01})
    (summary,) = train_locally(run_spec(str(memorising_model), tmp_path / "out", [job]), base=base, progress=False)
    losses = [json.loads(r)["loss"] for r in (tmp_path / "out/one/metrics.jsonl").read_text().splitlines()]
    assert summary.state == "stopped_early" and summary.steps < 100, (summary.steps, summary.reason)
    assert len(losses) == summary.steps
    assert losses[-1] < 1e-2 * losses[0]                       # it had learnt its example
    assert "min_delta" in summary.reason and f"first train loss {losses[0]:.4g}" in summary.reason, summary.reason


def plateau_job(data_dir: Path) -> dict:
    """lr 1e-7: the eval loss hardly moves; evaluated every 2 steps, the rule can stop it at its 6th
    evaluation (patience 3 + 3), i.e. step 12, and the job ends after step 13."""
    return job_dict("flat", write_task_data(data_dir, "flat"), 200, lr=1e-7, lr_schedule="constant", eval_split=8,
                    eval_every=2, checkpoint_every=1000, early_stop={"min_improvement": 0.05, "patience": 3})


def run_with_pause(tmp_path: Path, base, model_dir: Path, pause_after: int | None, late: int | None = None
                   ) -> tuple[list, list]:
    """Train the plateau job in a trainer loop with a fresh `JobData` per start (as the in-process driver
    and the service do); pause it after step `pause_after` and start it again. (The events, the eval
    losses its first start had made when it was paused.)"""
    spec = run_spec(str(model_dir), tmp_path / f"out-{pause_after}-{late}", [plateau_job(tmp_path / "data")])
    (submission,) = spec.submissions()
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model), "trainer-t",
                       tmp_path / f"state-{pause_after}-{late}")

    def start() -> None:
        data = JobData("flat", submission, base.tokenizer)
        summary = data.prepare()
        link = LocalJobLink(data) if late is None else LateVerdicts(data, seed=late)
        loop.assign(Assignment(job_id="flat", submission=submission, output_dir=Path(submission.output_dir),
                               data=summary, eval_examples=data.eval_examples(), link=link))

    start()
    events, evals_before = [], []
    if pause_after is not None:
        for _ in range(500):
            loop.run_once(idle_wait=0)
            events += loop.drain_events()
            if loop.active and loop.active["flat"].job.step == pause_after:
                break
        assert loop.active, [e.kind for e in events][-3:]
        evals_before = [(e.step, e.data["eval_loss"]) for e in events if e.kind == "eval"]
        loop.stop_job("flat", "paused", "preempted by the test")
        loop.run_once(idle_wait=0)
        events += loop.drain_events()
        if events[-1].kind == "paused":
            start()
    return events + run_until_idle(loop), evals_before


@pytest.mark.parametrize("pause_after,late", [(8, None), (11, None), (12, None), (12, 1), (13, None)],
                         ids=["before-plateau", "a-step-before-the-decision", "at-the-decision",
                              "at-the-decision-late-verdicts", "after-the-decision"])
def test_a_paused_job_stops_at_the_same_step_as_an_unpaused_one(tmp_path, tiny_model_dirs, pause_after, late):
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    unpaused, _ = run_with_pause(tmp_path, base, tiny_model_dirs["llama"], None)
    (expected,) = [e for e in unpaused if e.kind == "stopped_early"]
    assert expected.step == 13, expected
    events, evals_before = run_with_pause(tmp_path, base, tiny_model_dirs["llama"], pause_after, late)
    (ended,) = [e for e in events if e.kind == "stopped_early"]
    assert (ended.step, ended.data["reason"]) == (expected.step, expected.data["reason"])
    assert [e.step for e in events if e.kind == "progress"][-1] == ended.step
    if pause_after < expected.step:
        (resumed,) = [e for e in events if e.kind == "started" and e.data["resumed_from"]]
        assert resumed.data["resumed_from"] == pause_after
        # the evals made before the pause came back with the checkpoint: without them the rule would need
        # 6 evaluations after the resume (step >= pause_after + 12)
        assert [tuple(pair) for pair in resumed.data["evals"]] == evals_before != []
    evals = [(e.step, e.data["eval_loss"]) for e in events if e.kind == "eval"]
    assert evals == [(e.step, e.data["eval_loss"]) for e in unpaused if e.kind == "eval"]
