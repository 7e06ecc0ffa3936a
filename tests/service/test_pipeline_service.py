"""Pipeline trainers in the trainer loop (`stages: N`), against the single-device trainer as the reference: a
jobs file run in-process with `stages: 2` writes the same adapters, metrics, evaluations and stop step bit for
bit, though a stage process is killed mid-run; a job moved between the two trainer kinds (mid-accumulation
too) ends as if never interrupted; the service on Ray runs a pipeline trainer whose stage actor is killed
mid-run, and its jobs end as on one device; a "try it" withdrawn while it decodes over the stages stops there, as
on one device, in the loop and through the service on Ray over HTTP. CPU, float32, one thread in every process
(an SVD's or a reduction's rounding may depend on the thread count): tests/service/test_pipeline_trainer.py says
why such a pipeline is exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from actors.engine.models import load_base_model
from actors.service.pipeline.pipeline_engine import start_pipeline
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.local_run import train_locally
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.peft_adapters import saved_peft_lora
from tests.helpers.pipeline import one_thread_per_process
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_per_process()


def outputs(folder) -> dict:
    """What a run leaves in a job's folder that must not depend on the trainer kind."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"adapter": load_file(str(folder / "adapter_model.safetensors")), "metrics": rows,
            "config": json.loads((folder / "adapter_config.json").read_text())}


def assert_same_outputs(ours: dict, theirs: dict, name: str) -> None:
    assert ours["metrics"] == theirs["metrics"], name
    assert ours["config"] == theirs["config"], name
    assert ours["adapter"].keys() == theirs["adapter"].keys(), name
    for key, value in theirs["adapter"].items():
        assert torch.equal(ours["adapter"][key], value), (name, key)
    assert any(float(v.abs().max()) > 0 for k, v in ours["adapter"].items() if "lora_B" in k), "nothing trained"


def loop_for(kind: str, tmp_path, model: str, name: str) -> TrainerLoop:
    config = TrainerConfig(base_model=model, stages=2 if kind == "pipeline" else 1, stage_split="even", threads=1)
    if kind == "pipeline":
        return TrainerLoop(None, config, name, tmp_path / "state", engine=start_pipeline(config, threads=1))
    return TrainerLoop(load_base_model(model, dtype="float32", device="cpu"), config, name, tmp_path / "state")


def test_a_job_moved_between_trainer_kinds_ends_as_the_uninterrupted_one(tmp_path, tiny_model_dirs):
    """Paused on a pipeline at step 3 (its checkpoint written from the stages), resumed on one device and paused
    there mid-accumulation at step 5 (its checkpoint holds the accumulation's gradients, which the stages then
    take), resumed on a pipeline to the end: the same adapter and metrics as one device's uninterrupted run; with
    keep_best, the same best evaluation's adapter (kept from the stages, carried by the checkpoints)."""
    model = str(tiny_model_dirs["llama"])
    job = job_dict("moving", write_task_data(tmp_path / "data", "moving"), 8, grad_accum=2, checkpoint_every=3,
                   lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]},
                   eval_split=4, eval_every=2, keep_best="eval_loss")
    (submission,) = run_spec(model, tmp_path / "out", [job]).submissions()
    moves = [("pipeline", 3, 0), ("single", 5, 1), ("pipeline", None, 0)]
    for index, (kind, pause_at, extra) in enumerate(moves):
        loop = loop_for(kind, tmp_path, model, f"trainer-{index}")
        try:
            loop.assign(assignment_for(submission, "moving", loop.base.tokenizer))
            if pause_at is None:
                events = run_until_idle(loop)
            else:
                while loop.active.get("moving") is None or loop.active["moving"].job.step < pause_at:
                    loop.run_once(idle_wait=0)
                for _ in range(extra):   # micro-batches of the next step before the pause
                    loop.run_once(idle_wait=0)
                loop.stop_job("moving", "paused", "moved to another trainer")
                events = run_until_idle(loop)
        finally:
            loop.close()
        if index:
            assert next(e for e in events if e.kind == "started").data["resumed_from"] == moves[index - 1][1]
        if pause_at is not None:
            assert next(e for e in events if e.kind == "paused").data["checkpoint_step"] == pause_at
            state = json.loads((tmp_path / "out/moving/checkpoint/state.json").read_text())
            assert state["accumulator"]["micro_batches"] == extra
            assert sum(state["optimizer"]["gradients"]) == (len(state["optimizer"]["gradients"]) if extra else 0)
    assert any(e.kind == "completed" for e in events)
    uninterrupted = run_spec(model, tmp_path / "uninterrupted", [job])
    train_locally(uninterrupted, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    assert_same_outputs(outputs(tmp_path / "out/moving"), outputs(tmp_path / "uninterrupted/moving"), "moving")
    best = [json.loads((tmp_path / folder / "aspen.json").read_text())["best"]
            for folder in ("out/moving", "uninterrupted/moving")]
    assert best[0] == best[1] and best[0]["metric"] == "eval_loss", best


def test_a_grpo_job_moved_mid_replay_between_trainer_kinds_ends_as_the_uninterrupted_one(tmp_path, tiny_model_dirs):
    """A grpo job training each generation twice (num_iterations), 2 micro-batches a step, with a KL term: paused on
    a pipeline after its first generation's step (its checkpoint holds the generation and the last stage's
    log-probabilities of it), resumed on one device and paused there in the middle of a replay's accumulation,
    resumed on a pipeline to the end: the adapter and metrics of one device's uninterrupted run, bit for bit."""
    model = str(tiny_model_dirs["llama"])
    grpo = {"reward": "tests.helpers.rewards:shorter", "num_generations": 3, "max_new_tokens": 6, "num_iterations": 2,
            "beta": 0.2}
    job = job_dict("replayed", write_task_data(tmp_path / "data", "replayed"), 6, method="grpo", batch_size=2,
                   max_seq_len=64, grad_accum=2, checkpoint_every=1, grpo=grpo,
                   lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    (submission,) = run_spec(model, tmp_path / "out", [job]).submissions()
    moves = [("pipeline", 1, 0), ("single", 3, 1), ("pipeline", None, 0)]
    for index, (kind, pause_at, extra) in enumerate(moves):
        loop = loop_for(kind, tmp_path, model, f"trainer-{index}")
        try:
            loop.assign(assignment_for(submission, "replayed", loop.base.tokenizer))
            if pause_at is None:
                events = run_until_idle(loop)
            else:
                while loop.active.get("replayed") is None or loop.active["replayed"].job.step < pause_at:
                    loop.run_once(idle_wait=0)
                for _ in range(extra):   # micro-batches of the replay's step before the pause
                    loop.run_once(idle_wait=0)
                loop.stop_job("replayed", "paused", "moved to another trainer")
                events = run_until_idle(loop)
        finally:
            loop.close()
        if index:
            assert next(e for e in events if e.kind == "started").data["resumed_from"] == moves[index - 1][1]
        if pause_at is not None:
            state = json.loads((tmp_path / "out/replayed/checkpoint/state.json").read_text())
            assert state["step"] == pause_at and state["accumulator"]["micro_batches"] == extra, kind
            assert (state["replay"]["iteration"], state["replay"]["position"]) == (1, extra), state["replay"]
            assert len(state["replay"]["batches"]) == 2 and all(b["old_logps"] for b in state["replay"]["batches"])
    assert any(e.kind == "completed" for e in events)
    uninterrupted = run_spec(model, tmp_path / "uninterrupted", [job])
    train_locally(uninterrupted, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    assert_same_outputs(outputs(tmp_path / "out/replayed"), outputs(tmp_path / "uninterrupted/replayed"), "replayed")


def test_a_job_started_from_a_saved_adapter_on_a_pipeline_ends_as_on_one_device(tmp_path, tiny_model_dirs):
    """`init_adapter` on a pipeline trainer: the stages take the saved adapter (their shares of it), and the job
    ends with the adapter, metrics and config of the same job on one device, bit for bit."""
    model = str(tiny_model_dirs["llama"])
    targets = ["q_proj", "v_proj", "down_proj"]
    saved_peft_lora(model, tmp_path / "saved", targets, seed=0)
    ends = {}
    for kind in ("single", "pipeline"):
        job = job_dict("continued", write_task_data(tmp_path / "data", "continued"), 4,
                       init_adapter=str(tmp_path / "saved"),
                       lora={"r": 4, "alpha": 8, "target_modules": targets})
        (submission,) = run_spec(model, tmp_path / kind, [job]).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        try:
            loop.assign(assignment_for(submission, "continued", loop.base.tokenizer))
            events = run_until_idle(loop)
        finally:
            loop.close()
        started = next(e for e in events if e.kind == "started")
        assert started.data["checkpoint_note"] == f"its adapter started from {tmp_path / 'saved'}", kind
        ends[kind] = outputs(tmp_path / kind / "continued")
    assert_same_outputs(ends["pipeline"], ends["single"], "continued")
    first_loss = ends["single"]["metrics"][0]["loss"]
    fresh = job_dict("fresh", tmp_path / "data" / "continued.jsonl", 1,
                     lora={"r": 4, "alpha": 8, "target_modules": targets})
    (result,) = train_locally(run_spec(model, tmp_path / "fresh", [fresh]), progress=False)
    assert abs(result.first_loss - first_loss) > 1e-3, "the saved adapter made no difference: nothing was compared"


def test_a_dpo_job_from_a_saved_adapter_on_a_pipeline_compares_with_it_as_on_one_device(tmp_path, tiny_model_dirs):
    """A dpo job starting from a saved adapter holds that adapter as its reference on a pipeline trainer too: each
    stage its share, in the reference passes only; the job ends with the adapter, metrics and config of the same job
    on one device, bit for bit, its first reward margin 0 (policy and reference the same adapter)."""
    from tests.helpers.pairs import ROWS

    model = str(tiny_model_dirs["llama"])
    targets = ["q_proj", "v_proj", "down_proj"]
    saved_peft_lora(model, tmp_path / "saved", targets, seed=1)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    ends = {}
    for kind in ("single", "pipeline"):
        job = job_dict("dpo", pairs, 3, method="dpo", batch_size=2, format={"type": "preference"},
                       init_adapter=str(tmp_path / "saved"), lora={"r": 4, "alpha": 8, "target_modules": targets})
        (submission,) = run_spec(model, tmp_path / kind, [job]).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        try:
            loop.assign(assignment_for(submission, "dpo", loop.base.tokenizer))
            events = run_until_idle(loop)
        finally:
            loop.close()
        started = next(e for e in events if e.kind == "started")
        assert started.data["checkpoint_note"].endswith(f"its reference is {tmp_path / 'saved'}"), kind
        ends[kind] = outputs(tmp_path / kind / "dpo")
        kept = load_file(tmp_path / kind / "dpo" / "checkpoint" / "reference_model.safetensors")   # its copy
        original = load_file(tmp_path / "saved" / "adapter_model.safetensors")
        assert kept.keys() == original.keys() and all(torch.equal(kept[k], original[k]) for k in original), kind
    assert_same_outputs(ends["pipeline"], ends["single"], "dpo")
    assert ends["single"]["metrics"][0]["rewards/margins"] == 0.0
    assert any(row["rewards/margins"] != 0.0 for row in ends["single"]["metrics"][1:]), "the job did not train"


def test_eval_generate_and_try_it_on_a_pipeline_decode_as_on_one_device(tmp_path, tiny_model_dirs):
    """A job with eval_generate on a pipeline trainer: its generations (decoded over the stages, each stage's layers
    with a KV cache of their own) and scores, adapter and metrics are one device's, bit for bit; "try it" on the
    running job continues a prompt through its adapter and through the base as one device does; the stages train on
    after a decoding call."""
    from actors.service.outputs.job_files import read_generations

    model = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "scored")
    job = job_dict("scored", data, 6, eval_split=6, eval_every=3,
                   eval_generate={"metric": "contains", "max_new_tokens": 5},
                   lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    ends, tries = {}, {}
    for kind in ("single", "pipeline"):
        (submission,) = run_spec(model, tmp_path / kind, [job]).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        try:
            loop.assign(assignment_for(submission, "scored", loop.base.tokenizer))
            while loop.active.get("scored") is None or loop.active["scored"].job.step < 2:
                loop.run_once(idle_wait=0)
            tries[kind] = loop.try_prompt("scored", "Q: what is 3 and 9?\nA:", 6)
            events = run_until_idle(loop)
        finally:
            loop.close()
        assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]
        ends[kind] = outputs(tmp_path / kind / "scored")
        ends[kind]["generations"] = read_generations(tmp_path / kind / "scored")
    assert_same_outputs(ends["pipeline"], ends["single"], "scored")
    assert ends["pipeline"]["generations"] == ends["single"]["generations"]
    assert ends["single"]["generations"]["steps"] == [3, 6]
    assert any(row["prediction"] for row in ends["single"]["generations"]["rows"]), "nothing was generated"
    for key in ("adapter", "base", "new_tokens", "step"):
        assert tries["pipeline"][key] == tries["single"][key], key


def test_a_try_it_withdrawn_while_it_decodes_on_a_pipeline_stops_there_as_on_one_device(tmp_path, tiny_model_dirs,
                                                                                       monkeypatch):
    """A running job's "try it" on a pipeline trainer, withdrawn after its third decode step, stops there as on one
    device (`Withdrawn` after as many tokens, `withdrawn` asked once a step, not up to MAX_NEW_TOKENS times); the
    stages are left clean: the next "try it" answers as one device's, and the job trains on and ends with one
    device's adapter and metrics, bit for bit. No stop token: uncut, each would decode MAX_NEW_TOKENS tokens."""
    import actors.service.trainer.try_adapter as tries
    from actors.service.scheduler.call_waits import Withdrawn

    monkeypatch.setattr(tries, "stop_token_ids", lambda base: set())
    model = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "cut")
    job = job_dict("cut", data, 4, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    ends, cut, asked, tried = {}, {}, {}, {}
    for kind in ("single", "pipeline"):
        (submission,) = run_spec(model, tmp_path / kind, [job]).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        asks: list[int] = []

        def withdrawn(asks=asks) -> bool:   # the caller gone after the third decode step
            asks.append(1)
            return len(asks) > 3

        try:
            loop.assign(assignment_for(submission, "cut", loop.base.tokenizer))
            while loop.active.get("cut") is None or loop.active["cut"].job.step < 2:
                loop.run_once(idle_wait=0)
            with pytest.raises(Withdrawn) as stopped:
                loop.try_prompt("cut", "Q: what is 3 and 9?\nA:", tries.MAX_NEW_TOKENS, withdrawn=withdrawn)
            cut[kind], asked[kind] = str(stopped.value), len(asks)
            tried[kind] = loop.try_prompt("cut", "Q: what is 3 and 9?\nA:", 6)
            events = run_until_idle(loop)
        finally:
            loop.close()
        assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]
        ends[kind] = outputs(tmp_path / kind / "cut")
    assert f"after 3 of at most {tries.MAX_NEW_TOKENS} new tokens" in cut["single"], cut["single"]
    assert cut["pipeline"] == cut["single"] and asked["pipeline"] == asked["single"] == 4, (cut, asked)
    for key in ("adapter", "base", "new_tokens", "step"):
        assert tried["pipeline"][key] == tried["single"][key], key
    assert tried["single"]["new_tokens"] == [6, 6]
    assert_same_outputs(ends["pipeline"], ends["single"], "cut")


@pytest.mark.parametrize("lora", [{}, {"use_dora": True}, {"init_lora_weights": "pissa"}],
                         ids=["lora", "dora", "pissa"])
def test_a_finished_jobs_adapter_is_tried_on_a_pipeline_as_on_one_device(tmp_path, tiny_model_dirs, lora):
    """"Try it" on a finished job's saved adapter on a pipeline trainer, between two steps of a job training there:
    each stage holds its share of the adapter for the call only; the answer is one device's (of a job's folder as
    aspen writes it: plain LoRA, DoRA's magnitudes, PiSSA's converted form), the job training meanwhile ends bit for
    bit as on one device, and a folder cut short fails the call alone, naming the file, nothing left on a stage."""
    from actors.spec.job_spec import JobSpec
    from actors.spec.saved_adapter import WEIGHTS_NAME

    model = str(tiny_model_dirs["llama"])
    targets = ["q_proj", "v_proj", "down_proj"]
    finished = job_dict("finished", write_task_data(tmp_path / "data", "finished"), 4, lr=0.05,
                        lora={"r": 4, "alpha": 8, "target_modules": targets, **lora})
    train_locally(run_spec(model, tmp_path / "done", [finished]), progress=False)
    folder = tmp_path / "done" / "finished"
    spec = JobSpec.model_validate(finished)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / WEIGHTS_NAME).write_bytes((folder / WEIGHTS_NAME).read_bytes()[:100])
    busy = job_dict("busy", write_task_data(tmp_path / "data", "busy"), 4,
                    lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": targets})
    ends, tries = {}, {}
    for kind in ("single", "pipeline"):
        (submission,) = run_spec(model, tmp_path / kind, [busy]).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        try:
            loop.assign(assignment_for(submission, "busy", loop.base.tokenizer))
            while loop.active.get("busy") is None or loop.active["busy"].job.step < 2:
                loop.run_once(idle_wait=0)
            with pytest.raises(ValueError, match=rf"job finished's adapter cannot be tried: .*{WEIGHTS_NAME}"):
                loop.try_saved("finished", spec, str(broken), 3, "Q: what is 3 and 9?\nA:", 6)
            # nothing of it stayed held (the same name is attached again next, which an adapter left would refuse)
            tries[kind] = loop.try_saved("finished", spec, str(folder), 3, "Q: what is 3 and 9?\nA:", 6)
            events = run_until_idle(loop)
        finally:
            loop.close()
        assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]
        ends[kind] = outputs(tmp_path / kind / "busy")
    assert_same_outputs(ends["pipeline"], ends["single"], "busy")
    assert tries["pipeline"] == {**tries["single"], "seconds": tries["pipeline"]["seconds"]}
    assert tries["single"]["adapter"] != tries["single"]["base"], "the adapter changed nothing: nothing was compared"


def test_grpo_jobs_on_a_pipeline_sample_over_the_stages_and_end_as_on_one_device(tmp_path, tiny_model_dirs):
    """Two grpo jobs fused on a pipeline trainer: their completions sampled over the stages (the same seeds as one
    device), their rewards scored in the engine's worker, their steps through the stages. One accumulates 3
    micro-batches a step, its data ending in the second step's second (the whole accumulation sampled before the
    step), and trains on each generation twice (num_iterations: the replay against the last stage's log-probabilities
    at the generation); the other, with beta > 0, starts from a saved adapter, its KL term's reference (that adapter)
    passed through the stages each step. Each ends with the adapter, metrics (rewards, clip ratios, lengths, kl) and
    config of one device, bit for bit."""
    model = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "rl")
    short = write_task_data(tmp_path / "data", "short", rows=10)
    grpo = {"reward": "tests.helpers.rewards:shorter", "num_generations": 3, "max_new_tokens": 6}   # varies
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    saved_peft_lora(model, tmp_path / "saved", lora["target_modules"], seed=2)
    ends = {}
    for kind in ("single", "pipeline"):
        jobs = [job_dict("rl", short, 0, method="grpo", batch_size=2, max_seq_len=64, lora=lora,
                         grad_accum=3, max_steps=None, epochs=1, grpo={**grpo, "num_iterations": 2}),
                job_dict("kl", data, 3, method="grpo", batch_size=2, max_seq_len=64, lora=lora,
                         grpo={**grpo, "beta": 0.5, "temperature": 0.8}, init_adapter=str(tmp_path / "saved"))]
        submissions = run_spec(model, tmp_path / kind, jobs).submissions()
        loop = loop_for(kind, tmp_path, model, f"trainer-{kind}")
        try:
            for submission, name in zip(submissions, ("rl", "kl"), strict=True):
                loop.assign(assignment_for(submission, name, loop.base.tokenizer))
            events = run_until_idle(loop)
        finally:
            loop.close()
        assert sum(e.kind == "completed" for e in events) == 2, [(e.kind, e.data.get("reason")) for e in events]
        ends[kind] = {name: outputs(tmp_path / kind / name) for name in ("rl", "kl")}
    for name in ("rl", "kl"):
        assert_same_outputs(ends["pipeline"][name], ends["single"][name], name)
    assert len(ends["single"]["rl"]["metrics"]) == 4 and all("reward" in row for row in ends["single"]["rl"]["metrics"])
    kls = [row["kl"] for row in ends["single"]["kl"]["metrics"]]
    assert kls[0] == 0.0 and any(kl > 0 for kl in kls[1:]), kls   # policy = reference at first, then apart


def test_a_jobs_file_with_stages_trains_as_on_one_device_though_a_stage_is_killed(tmp_path, tiny_model_dirs, caplog):
    """`aspen run --in-process` with `stages: 2`: the same adapters, metrics, evaluations and early stop as one
    device, bit for bit, though stage 1's process is SIGKILLed after the third loop step: the trainer gives
    every job back (paused, to resume from its last checkpoint), starts new stages, and nothing is lost."""
    import multiprocessing
    import os
    import signal

    data = tmp_path / "data"
    jobs = [job_dict("plain", write_task_data(data, "plain"), 7, eval_split=4, eval_every=2, checkpoint_every=2),
            job_dict("accum", write_task_data(data, "accum", offset=3), 6, grad_accum=2, max_grad_norm=0.05,
                     checkpoint_every=2,
                     lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}),
            job_dict("flat", write_task_data(data, "flat", offset=5), 60, lr=1e-7, lr_schedule="constant",
                     eval_split=8, eval_every=2, checkpoint_every=3,
                     early_stop={"min_improvement": 0.05, "patience": 3})]
    model = str(tiny_model_dirs["llama"])
    reference = run_spec(model, tmp_path / "single", jobs, step_tokens=512)
    expected = train_locally(reference, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    killed: list[int] = []

    def kill_stage_once(report) -> None:
        if report.step == 3 and not killed:
            (stage,) = [p for p in multiprocessing.active_children() if p.name == "aspen-stage-1"]
            os.kill(stage.pid, signal.SIGKILL)
            killed.append(stage.pid)

    staged = run_spec(model, tmp_path / "staged", jobs, step_tokens=512).model_copy(
        update={"stages": 2, "stage_split": "even"})
    summaries = train_locally(staged, progress=False, trainer={"threads": 1}, on_step=kill_stage_once)
    assert killed, "no stage was killed: the test tested nothing"
    assert "pipeline stage lost: stage 1 (exit code -9)" in caplog.text
    assert [(s.name, s.state, s.steps, s.evals) for s in summaries] == \
        [(s.name, s.state, s.steps, s.evals) for s in expected]
    assert [s.state for s in summaries] == ["completed", "completed", "stopped_early"]
    for job in jobs:
        assert_same_outputs(outputs(tmp_path / "staged" / job["name"]), outputs(tmp_path / "single" / job["name"]),
                            job["name"])
    trainer_rows = [json.loads(line) for line in (tmp_path / "staged/trainer.jsonl").read_text().splitlines()]
    assert trainer_rows and all(row["tokens"] > 0 for row in trainer_rows)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("aspen-stage")], \
        "a stage process outlived the run"


def test_stages_that_cannot_start_again_leave_the_trainer_to_try_at_the_next_job(tmp_path, tiny_model_dirs, caplog):
    """Stage 1 is SIGKILLed mid-run and its replacement cannot start (the first relaunch fails): the job is
    given back (paused, to be retried), the failure is logged, and the trainer stays usable: the job assigned
    again starts new stages and ends as one device's uninterrupted run."""
    import multiprocessing
    import os
    import signal

    model = str(tiny_model_dirs["llama"])
    job = job_dict("again", write_task_data(tmp_path / "data", "again"), 6, checkpoint_every=2)
    (submission,) = run_spec(model, tmp_path / "out", [job]).submissions()
    loop = loop_for("pipeline", tmp_path, model, "trainer-relaunch")
    launch, failures = loop.trainer.launch, []

    def failing_once():
        if not failures:
            failures.append(1)
            raise OSError("no room for the new stage (a test's failing relaunch)")
        return launch()

    loop.trainer.launch = failing_once
    try:
        loop.assign(assignment_for(submission, "again", loop.base.tokenizer))
        while loop.active.get("again") is None or loop.active["again"].job.step < 3:
            loop.run_once(idle_wait=0)
        (stage,) = [p for p in multiprocessing.active_children() if p.name == "aspen-stage-1"]
        os.kill(stage.pid, signal.SIGKILL)
        events = run_until_idle(loop)
        paused = [e for e in events if e.kind == "paused"]
        assert paused and paused[-1].data["retry"] and "lost a stage" in paused[-1].data["reason"], events
        assert failures and "its pipeline stages could not be started again" in caplog.text
        loop.assign(assignment_for(submission, "again", loop.base.tokenizer))
        events = run_until_idle(loop)
    finally:
        loop.close()
    assert next(e for e in events if e.kind == "started").data["resumed_from"] == 2
    assert any(e.kind == "completed" for e in events), events
    uninterrupted = run_spec(model, tmp_path / "uninterrupted", [job])
    train_locally(uninterrupted, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    assert_same_outputs(outputs(tmp_path / "out/again"), outputs(tmp_path / "uninterrupted/again"), "again")


def test_a_stage_lost_as_a_finished_job_leaves_costs_no_job_its_end(tmp_path, tiny_model_dirs):
    """Stage 1 dies just after a finished job's adapter and checkpoint were written, before the job is taken off
    the stages (so the loss is found there first): the job's end is still reported (completed, its adapter as
    one device's), and the job running beside it is given back and ends as one device's run. Before, that job's
    end was never reported: the scheduler kept it "running" on the trainer for ever (CI's timeouts of
    test_the_service_on_ray_runs_a_pipeline_trainer_as_one_device, 2026-11-29)."""
    import multiprocessing
    import os
    import signal

    model = str(tiny_model_dirs["llama"])
    jobs = [job_dict("short", write_task_data(tmp_path / "data", "short"), 2, checkpoint_every=1),
            job_dict("long", write_task_data(tmp_path / "data", "long", offset=3), 6, checkpoint_every=2)]
    submissions = run_spec(model, tmp_path / "out", jobs).submissions()
    loop = loop_for("pipeline", tmp_path, model, "trainer-leaving")
    remove_job, killed = loop.trainer.remove_job, []

    def stage_dies_first(name: str):
        if name == "short" and not killed:
            (stage,) = [p for p in multiprocessing.active_children() if p.name == "aspen-stage-1"]
            os.kill(stage.pid, signal.SIGKILL)
            stage.join(10)
            killed.append(stage.pid)
        return remove_job(name)

    loop.trainer.remove_job = stage_dies_first
    try:
        loop.assign([assignment_for(s, s.job.name, loop.base.tokenizer) for s in submissions])
        events = run_until_idle(loop)
        assert killed, "the stage was not killed: the test tested nothing"
        ends = {(e.job_id, e.kind) for e in events if e.kind in ("completed", "paused", "failed")}
        assert ends == {("short", "completed"), ("long", "paused")}, events
        loop.assign([assignment_for(submissions[1], "long", loop.base.tokenizer)])
        events = run_until_idle(loop)
    finally:
        loop.close()
    assert ("long", "completed") in {(e.job_id, e.kind) for e in events}, events
    uninterrupted = run_spec(model, tmp_path / "uninterrupted", jobs)
    train_locally(uninterrupted, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    for name in ("short", "long"):
        assert_same_outputs(outputs(tmp_path / "out" / name), outputs(tmp_path / "uninterrupted" / name), name)


def test_jobs_assigned_together_when_a_stage_is_found_lost_all_start_on_the_new_stages(tmp_path, tiny_model_dirs):
    """Stage 1 dies while no job runs; two jobs then arrive in one assignment. The first one's start finds the
    stage lost (it is given back, to be retried); the second is not dropped with the rest of the command (it
    was: the scheduler kept it "running" on a trainer that never had it): it starts on the new stages and
    ends as one device's run."""
    import multiprocessing
    import os
    import signal

    model = str(tiny_model_dirs["llama"])
    jobs = [job_dict(name, write_task_data(tmp_path / "data", name, offset=i), 3)
            for i, name in enumerate(["first", "second"])]
    submissions = run_spec(model, tmp_path / "out", jobs).submissions()
    loop = loop_for("pipeline", tmp_path, model, "trainer-together")
    try:
        (stage,) = [p for p in multiprocessing.active_children() if p.name == "aspen-stage-1"]
        os.kill(stage.pid, signal.SIGKILL)
        stage.join(10)
        loop.assign([assignment_for(s, s.job.name, loop.base.tokenizer) for s in submissions])
        events = run_until_idle(loop)
    finally:
        loop.close()
    by_job = {(e.job_id, e.kind) for e in events}
    assert ("first", "paused") in by_job and ("second", "completed") in by_job, events
    uninterrupted = run_spec(model, tmp_path / "uninterrupted", jobs[1:])
    train_locally(uninterrupted, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    assert_same_outputs(outputs(tmp_path / "out/second"), outputs(tmp_path / "uninterrupted/second"), "second")


@pytest.mark.long   # ~60 s on CI's machine: jobs on a two-stage pipeline trainer on Ray, its stage actor killed
def test_the_service_on_ray_runs_a_pipeline_trainer_as_one_device(ray_session, tiny_model_dirs, tmp_path):
    """`aspen run`'s service on Ray with a `stages: 2` trainer: the trainer actor runs stage 0, stage 1 is a
    stage actor in the trainer's placement group. The stage actor is killed mid-run (once the first job's status
    shows its checkpoint at step 5 of 210, so that the jobs cannot have ended before the kill lands): the trainer
    starts a new one and every job resumes from its checkpoint; the jobs end as the in-process single-device run
    ends them; "try it" on a finished job runs on the pipeline trainer (the only one holding the base) as on one
    device; and the placement group is freed when the service stops."""
    import ray

    from actors.service.scheduler.config import run_service_config
    from orchestrator.client import Client
    from tests.helpers.service import ray_actor_logs, wait_for

    data = tmp_path / "data"
    # The kill follows the first job's status, the scheduler's table, a poll behind the trainer (a loaded
    # machine's scheduler, at nice 10, seconds late). The trainer's loop stepped every 12-47 ms here (a checkpoint
    # every 2 steps, an eval every 3; this 2-core AMD EPYC is CI's faster machine): at 60 steps 0.7-2.7 s were
    # left after step 2, and jobs that end first lose no stage. Now 210 steps, a checkpoint every 5 (steps of
    # 11-45 ms here): 205 steps after the checkpoint at 5 leave >=2 s at a floor of 10 ms a step. Every step is
    # trained twice (the service, the reference)
    jobs = [job_dict("plain", write_task_data(data, "plain"), 210, eval_split=4, eval_every=3, checkpoint_every=5),
            job_dict("accum", write_task_data(data, "accum", offset=3), 4, grad_accum=2, checkpoint_every=1)]
    model = str(tiny_model_dirs["llama"])
    reference = run_spec(model, tmp_path / "single", jobs, step_tokens=512)
    expected = train_locally(reference, base=load_base_model(model, dtype="float32", device="cpu"), progress=False)
    staged = run_spec(model, tmp_path / "staged", jobs, step_tokens=512).model_copy(
        update={"stages": 2, "stage_split": "even"})

    def stage_actors() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if ".stage-1." in a["name"]]

    client = Client.local(run_service_config(staged, tick_seconds=0.1, trainer={"num_cpus": 0.5, "threads": 1}))
    try:
        handles = client.submit_run(staged)
        wait_for(lambda: (client.status(handles[0].id).checkpoint_step or 0) >= 5, what="the first job's checkpoint")
        (first,) = stage_actors()
        namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["name"] == first)
        ray.kill(ray.get_actor(first, namespace=namespace))
        try:
            records = {r.name: r for r in client.wait_all([h.id for h in handles], timeout=300)}
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{ray_actor_logs('TrainerActor', 'StageActor')}") from error
        reasons = [reason for handle in handles for _, _, reason in client.transitions(handle.id)]
        replaced = stage_actors()
        tried = client.generate(handles[1].id, "Q: what is 3 and 9?\nA:", 6)   # a finished job's, on the stages
    finally:
        client.shutdown()
    assert replaced and replaced != [first], "no new stage actor replaced the killed one"
    assert any("lost a stage" in reason for reason in reasons), ("the jobs ended before the kill?", reasons)
    assert {name: (r.state, r.step, r.eval_loss) for name, r in records.items()} == \
        {s.name: (s.state, s.steps, s.eval_loss) for s in expected}
    for job in jobs:
        assert_same_outputs(outputs(tmp_path / "staged" / job["name"]), outputs(tmp_path / "single" / job["name"]),
                            job["name"])
    from actors.service.trainer.try_adapter import try_saved_adapter
    from actors.spec.job_spec import JobSpec

    alone = try_saved_adapter(load_base_model(model, dtype="float32", device="cpu"), JobSpec.model_validate(jobs[1]),
                              tmp_path / "single" / "accum", "accum", 4, "Q: what is 3 and 9?\nA:", 6)
    assert (tried["adapter"], tried["base"]) == (alone["adapter"], alone["base"])
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].endswith(".stages")]
    assert groups and all(g["state"] == "REMOVED" for g in groups), groups


STEP_S = 0.2   # each decode step of a "try it" on the pipeline trainer, slowed in the trainer's process


@pytest.mark.long   # ~60 s: a service on Ray with a two-stage pipeline trainer, a job training on it
def test_a_try_it_on_a_pipeline_trainer_whose_http_client_disconnects_stops_and_the_trainer_trains_on(
        ray_session, tiny_model_dirs, tmp_path):
    """The service on Ray with a `stages: 2` trainer, the HTTP API over it: a running job's "try it" (decoded over
    the stages, each step 0.2 s slower in the trainer's process, no stop token: ~50 s uncut) whose client hangs up
    after three decode steps stops within seconds (Withdrawn, under a quarter of its tokens; the trainer's
    TicketWatch asked the scheduler), its ticket gone, and the job trains on on the stages."""
    from orchestrator.client import Client
    from orchestrator.http.api import ServiceLink, create_app
    from orchestrator.http.api_client import HttpClient
    from orchestrator.http.token import ensure_token
    from tests.helpers.http_server import running_server
    from tests.helpers.service import NO_LISTENERS, service_config, wait_for
    from tests.helpers.try_it_probes import (
        hang_up_while_decoding,
        post_and_hold,
        slow_decoding,
        tickets,
        trainer_handle,
    )

    max_tokens = 256
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], listeners=NO_LISTENERS, stages=2,
                            stage_split="even")
    service = Client.local(config)
    token = ensure_token(tmp_path / "http-token")
    folder = tmp_path / "decoding"
    folder.mkdir()
    steps, ended = folder / "steps", folder / "ended"
    try:
        with running_server(create_app(ServiceLink(client=service), token)) as url:
            http = HttpClient(url, token)
            job = http.submit(job_dict("cut", write_task_data(tmp_path / "data", "cut"), 100_000,
                                       checkpoint_every=100_000), base_model=str(tiny_model_dirs["llama"]))
            record = wait_for(lambda: (r := service.status(job.id)).state == "running" and r.step >= 1 and r,
                              timeout=240, what="the job to train on the stages", state=lambda: service.status(job.id))
            stages = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)
                      if ".stage-1." in a["name"]]
            assert stages, "the trainer runs no second stage: not a pipeline"
            handle = trainer_handle(service, record.trainer)
            slow_decoding(handle, str(folder), STEP_S)
            prompt = {"prompt": "Q: cut 1 and 3\nA:", "max_new_tokens": max_tokens}
            connection = post_and_hold(url, token, f"/v1/jobs/{job.id}/generate", prompt)
            hang_up_while_decoding(connection, steps, ended, max_tokens)   # decoding over the stages
            assert tickets(service) == []
            step = service.status(job.id).step   # the trainer free again: the job trains on over its stages
            wait_for(lambda: service.status(job.id).step >= step + 2, timeout=60, what="the job to train on",
                     state=lambda: service.status(job.id))
            slow_decoding(handle, None, STEP_S)
            http.cancel(job.id)
    finally:
        service.shutdown()
