"""Helpers of the keep_best tests: a job that overfits the memorising model (its held-out loss falls, then rises),
its evaluations as its metrics.jsonl recorded them, and the job paused and resumed in a new trainer loop."""

from __future__ import annotations

import json
from pathlib import Path

from actors.engine.models import load_base_model
from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.service import job_dict, run_spec
from tests.helpers.trainer import assignment_for, run_until_idle

WORDS = "apple river stone cloud piano tiger lemon candle rocket forest violin marble garden copper window planet"


def overfitting_job(folder: Path, steps: int, **extra) -> dict:
    """16 rows, each its own answer word (4 held out): the held-out loss falls for ~10 steps (the shared
    'the answer is'), then rises as the training rows' words are memorised."""
    path = folder / "rows.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": f"item {i}", "answer": f"the answer is {word}"}) + "\n"
                            for i, word in enumerate(WORDS.split())))
    return job_dict("fit", path, steps, lr=3e-3, lr_schedule="constant", eval_split=4, eval_every=2,
                    checkpoint_every=1000, lora={"r": 8, "alpha": 16, "target_modules": "all-linear"}, **extra)


def eval_losses(folder: Path, column: str = "eval_loss") -> dict[int, float]:
    """Step -> the job's `column` (eval_loss, eval_score) where its metrics.jsonl has one."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[column] for row in rows if column in row}


def paused_then_resumed(tmp_path: Path, model: Path, job: dict, pause_after: int, damage=None) -> tuple[list, list]:
    """Train `job` in a trainer loop, pause it after step `pause_after` (its checkpoint written), `damage` its
    checkpoint folder, and resume it in a new loop (a restarted trainer) to its end: each loop's events."""
    spec = run_spec(str(model), tmp_path / "paused", [job])
    (submission,) = spec.submissions()
    base = load_base_model(str(model), dtype="float32", device="cpu")
    first = TrainerLoop(base, TrainerConfig(base_model=spec.base_model), "trainer-t", tmp_path / "state")
    first.assign(assignment_for(submission, "fit-1", base.tokenizer))
    for _ in range(100):
        first.run_once(idle_wait=0)
        if first.active and first.active["fit-1"].job.step == pause_after:
            break
    first.stop_job("fit-1", "paused", "preempted by the test")
    before = run_until_idle(first)
    if damage is not None:
        damage(tmp_path / "paused/fit/checkpoint")
    second = TrainerLoop(base, TrainerConfig(base_model=spec.base_model), "trainer-u", tmp_path / "state")
    second.assign(assignment_for(submission, "fit-1", base.tokenizer))
    return before, run_until_idle(second)
