"""A user's function on a trainer (a GRPO reward, an eval_generate metric) that never returns, ends its
interpreter or prints: caused here, on a trainer holding that job beside another. The function's job fails saying
what happened and what to do, within its timeout; the other job goes on; the next call (a new process) scores as
before; prints do not disturb the answers; the functions' process does not outlive its trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from actors.engine.grpo_rewards import RewardError
from actors.engine.job import TrainingJob
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.grpo_jobs import grpo_spec as _grpo_spec
from tests.helpers.grpo_jobs import number_base as _number_base
from tests.helpers.grpo_jobs import prompt_rows as _prompt_rows
from tests.helpers.isolation import VOCAB
from tests.helpers.models import random_examples

REPO = Path(__file__).resolve().parents[2]


def _trainer_with(reward: str, timeout_s: float = 60.0) -> tuple[FusedTrainer, TrainingJob]:
    base = _number_base()
    trainer = FusedTrainer(base)
    spec = _grpo_spec("grpo", reward, grpo={"reward": reward, "num_generations": 4, "max_new_tokens": 5,
                                            "reward_timeout_s": timeout_s})
    trainer.add_job(TrainingJob.create(spec, base, _prompt_rows(0, 4), [], seed=0))
    trainer.add_job(TrainingJob.create(JobSpec(name="sft", data="unused.jsonl", format={"type": "text"},
                                               batch_size=2, max_steps=2), base, random_examples(1, count=4,
                                                                                             vocab=VOCAB), [], seed=1))
    return trainer, trainer.jobs["grpo"]


@pytest.mark.parametrize(("reward", "timeout_s", "message"), [
    ("tests.helpers.rewards:hangs", 1.0, "did not return within 1 s (grpo.reward_timeout_s) on 8 completions and "
                                        "was stopped; make it faster or raise grpo.reward_timeout_s"),
    ("tests.helpers.rewards:exits", 60.0, "its process ended (exit code 3; it exited or crashed, its output is in the "
                                          "trainer's log) while scoring 8 completions")])
def test_a_reward_that_hangs_or_exits_fails_its_job_alone_and_the_next_call_scores(reward, timeout_s, message):
    trainer, job = _trainer_with(reward, timeout_s)
    started = time.monotonic()
    kept, failed = trainer.rollouts(trainer.compose())
    took = time.monotonic() - started
    assert [j.name for j, _ in kept] == ["sft"] and [j.name for j, _ in failed] == ["grpo"]
    assert isinstance(failed[0][1], RewardError) and message in str(failed[0][1]), failed[0][1]
    assert f"grpo.reward '{reward}'" in str(failed[0][1])
    assert took < timeout_s + 30, took   # the deadline, plus sampling the completions on a busy machine
    assert trainer.run_step(kept).results[0].job == "sft"       # the others' step goes on
    assert trainer.functions.process is None                      # the stuck or dead process is gone
    good = _grpo_spec("good", "tests.helpers.rewards:prints",
                      grpo={"reward": "tests.helpers.rewards:prints", "num_generations": 4, "max_new_tokens": 5})
    trainer.remove_job("grpo")
    trainer.add_job(TrainingJob.create(good, trainer.base, _prompt_rows(0, 4), [], seed=0))
    kept, failed = trainer.rollouts(trainer.compose())
    assert not failed and {j.name for j, _ in kept} == {"good", "sft"}
    rollout = next(batch for j, batch in kept if j.name == "good")[0]
    assert list(rollout.rewards) == [score for (score,) in rollout.scores]
    assert all(0 < reward <= 1 for reward in rollout.rewards)    # 1 / (1 + length): its prints did not disturb them
    trainer.close()
    assert trainer.functions.process is None


def test_the_rewards_process_ends_with_its_trainer(tmp_path):
    """A trainer killed while its reward hangs: the functions' process ends too (within its check's second)."""
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(REPO)!r})
        from actors.engine.user_calls import FunctionWorker
        worker = FunctionWorker()
        threading.Thread(target=worker.call, args=("tests.helpers.rewards:hangs", "grpo.reward", "batch",
                         [["p"], ["c"], [{{"prompt": "p", "reference": "r"}}]], 3600.0), daemon=True).start()
        import time
        while worker.process is None:
            time.sleep(0.05)
        print(worker.process.pid, flush=True)
        time.sleep(3600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    child = int(parent.stdout.readline())
    time.sleep(1.0)   # the reward is running (hanging) now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.2)
    assert not _alive(child), f"the reward's process {child} outlived its trainer"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"   # a zombie has ended (its parent, gone, cannot reap it until init does)


def test_through_the_service_a_hanging_reward_fails_its_job_with_the_reason_and_the_other_job_completes(
        tiny_model_dirs, tmp_path):
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec
    from tests.helpers.service import job_dict, write_task_data

    data = write_task_data(tmp_path / "data", "arith")
    grpo = job_dict("grpo", data, 3, method="grpo", batch_size=2,
                    grpo={"reward": ["contains", "tests.helpers.rewards:hangs"], "num_generations": 3,
                          "max_new_tokens": 6, "reward_timeout_s": 1.0})
    spec = RunSpec(base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "runs", step_tokens=2048,
                   jobs=[grpo, job_dict("sft", data, 3)])
    results = {r.name: r for r in train_locally(spec, progress=False)}
    assert results["sft"].state == "completed", results["sft"].reason
    assert results["grpo"].state == "failed"
    assert "grpo.reward 'tests.helpers.rewards:hangs' did not return within 1 s" in results["grpo"].reason, \
        results["grpo"].reason


def test_a_metric_that_hangs_fails_its_job_with_the_reason_and_the_other_job_completes(tiny_model_dirs, tmp_path):
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec
    from tests.helpers.service import job_dict, write_task_data

    data = write_task_data(tmp_path / "data", "arith")
    judged = job_dict("judged", data, 4, eval_split=4, eval_every=2,
                      eval_generate={"metric": "tests.helpers.metrics:hangs", "max_new_tokens": 3, "timeout_s": 1.0})
    spec = RunSpec(base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "runs", step_tokens=2048,
                   jobs=[judged, job_dict("other", data, 4, eval_split=4, eval_every=2,
                                          eval_generate={"metric": "contains", "max_new_tokens": 3})])
    results = {r.name: r for r in train_locally(spec, progress=False)}
    assert results["other"].state == "completed", results["other"].reason
    assert results["judged"].state == "failed"
    assert ("eval_generate metric 'tests.helpers.metrics:hangs' did not score 4 eval rows within 1 s "
            "(eval_generate.timeout_s) and was stopped") in results["judged"].reason, results["judged"].reason


def test_a_metric_that_returns_a_word_is_named_with_its_row():
    from actors.engine.generation_eval import MetricError, generation_scores_of
    from actors.engine.user_calls import FunctionWorker
    from actors.spec.evaluation_config import GenerationEval

    worker = FunctionWorker()
    config = GenerationEval(metric="tests.helpers.metrics:says")
    rows = [{"prompt": "p", "reference": "first"}, {"prompt": "p", "reference": "second"}]
    assert generation_scores_of(config, ["a"], rows[:1], worker) == [1.0]
    with pytest.raises(MetricError) as caught:
        generation_scores_of(config, ["a", "b"], rows, worker)
    assert str(caught.value) == ("eval_generate metric 'tests.helpers.metrics:says' failed on eval row 1 (prediction "
                                 "'b'): could not convert string to float: 'yes'; it must return a number for any text")
    worker.close()


def test_a_jobs_file_whose_reward_module_hangs_or_exits_as_it_is_imported_is_refused_at_its_line(tmp_path,
                                                                                                monkeypatch):
    """A reward named by its file is loaded when the jobs file is read, in a process of its own: one whose import
    never ends is stopped after the load deadline (here 2 s) and refused at its line, saying so; one that exits the
    interpreter is refused with its exit code; the command reading the file goes on either way (this process)."""
    import yaml

    from actors.engine import user_calls
    from orchestrator.jobs_file import SpecError, load_run_spec
    from tests.helpers.service import job_dict, write_task_data

    monkeypatch.setattr(user_calls, "LOAD_TIMEOUT_S", 2.0)
    data = write_task_data(tmp_path / "data", "arith")
    (tmp_path / "waits.py").write_text("import time\ntime.sleep(3600)\n\ndef reward(p, c, r):\n    return [0.0]\n")
    (tmp_path / "exits.py").write_text("import os\nos._exit(7)\n")
    (tmp_path / "fine.py").write_text("print('imported')\n\ndef reward(p, c, r):\n    return [1.0] * len(c)\n")
    job = job_dict("grpo", data, 3, method="grpo", batch_size=2,
                   grpo={"reward": ["fine.py:reward", "waits.py:reward", "exits.py:reward"], "num_generations": 3})
    text = yaml.safe_dump({"base_model": "smollm2-135m", "jobs": [job]}, default_flow_style=False)
    (tmp_path / "jobs.yaml").write_text(text)
    started = time.monotonic()
    with pytest.raises(SpecError) as refused:
        load_run_spec(tmp_path / "jobs.yaml")
    assert time.monotonic() - started < 30
    lines = {row.strip(): n for n, row in enumerate(text.splitlines(), 1)}
    assert str(refused.value).splitlines() == [
        f"{tmp_path / 'jobs.yaml'}:{lines['- waits.py:reward']}: job 'grpo' (jobs[0]), field grpo.reward.1: "
        f"'{tmp_path / 'waits.py'}:reward' did not load within 2 s (does its module wait for something as it is "
        "imported?) and was stopped",
        f"{tmp_path / 'jobs.yaml'}:{lines['- exits.py:reward']}: job 'grpo' (jobs[0]), field grpo.reward.2: "
        f"'{tmp_path / 'exits.py'}:reward': importing it ended the process (exit code 7: its module exits or crashes "
        "the interpreter as it runs)"]
