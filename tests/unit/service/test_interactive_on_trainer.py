"""Interactive models (the Tinker API's) on a trainer loop beside its jobs (actors/service/trainer/trainer_loop.py
hosting actors/service/trainer/interactive_calls.py): a job trained while an interactive model's calls run on
the same base ends with exactly the adapter it ends with alone, and the interactive model's call returns exactly
what the same call returns on the engine alone; a call that arrives while the loop idles wakes it."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import load_base_model
from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.interactive_calls import adapter_name
from actors.service.trainer.trainer_loop import TrainerLoop
from tests.helpers.models import VOCAB
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle


def call_datums() -> tuple[CallDatum, ...]:
    generator = torch.Generator().manual_seed(5)
    datums = []
    for length in (9, 14):
        datums.append(CallDatum(tuple(torch.randint(0, VOCAB, (length,), generator=generator).tolist()),
                                {"target_tokens": torch.randint(0, VOCAB, (length,), generator=generator),
                                 "weights": torch.ones(length)}))
    return tuple(datums)


def train_job(tiny_model_dirs, tmp_path, *, with_interactive: bool):
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    data = write_task_data(tmp_path / "data", "a", rows=16)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                    [job_dict("a", data, 3, max_seq_len=32)], step_tokens=256)
    (submission,) = spec.submissions()
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=256), "trainer-0",
                       tmp_path / "state")
    outputs = None
    if with_interactive:
        loop.interactive.create_model("alice:train:0", 4, owner="alice")
        call = ModelCall(adapter_name("alice:train:0"), call_datums())
        outputs = loop.interactive.submit("alice:train:0", 1, "forward_backward", call)
        stepped = loop.interactive.submit("alice:train:0", 2, "optim_step", AdamStep(learning_rate=0.01))
    loop.assign(assignment_for(submission, "a", base.tokenizer))
    run_until_idle(loop)
    if with_interactive:
        deadline = time.monotonic() + 30
        while not stepped.done() and time.monotonic() < deadline:
            loop.run_once(idle_wait=0.05)
        outputs = outputs.result(timeout=1)
    loop.close()
    adapter = load_file(tmp_path / "out" / "a" / "adapter_model.safetensors")
    steps = [json.loads(line) for line in (tmp_path / "out" / "a" / "metrics.jsonl").read_text().splitlines()]
    return adapter, outputs, steps


def test_a_job_beside_an_interactive_model_trains_as_alone_and_the_model_gets_the_engines_answer(
        tiny_model_dirs, tmp_path):
    alone, _, alone_steps = train_job(tiny_model_dirs, tmp_path / "alone", with_interactive=False)
    beside, output, steps = train_job(tiny_model_dirs, tmp_path / "beside", with_interactive=True)
    assert [row["loss"] for row in steps] == [row["loss"] for row in alone_steps]
    assert set(beside) == set(alone)
    for name, tensor in alone.items():
        assert torch.equal(beside[name], tensor), name
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    InteractiveModel(base, "reference", 4)
    (expected,) = run_calls(base, [ModelCall("reference", call_datums())], backward=True)
    assert output.loss_sum == expected.loss_sum
    for ours, theirs in zip(output.logprobs, expected.logprobs, strict=True):
        assert torch.equal(ours, theirs)


def test_a_call_that_arrives_while_the_loop_idles_wakes_it(tiny_base, tmp_path):
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model="tiny", step_tokens=256), "trainer-0", tmp_path / "s")
    loop.interactive.create_model("alice:train:0", 4, owner="alice")
    call = ModelCall(adapter_name("alice:train:0"), call_datums())
    started = time.monotonic()
    threading.Timer(0.2, lambda: loop.interactive.submit("alice:train:0", 1, "forward", call)).start()
    loop.run_once(idle_wait=30)   # woken by the call, not after 30 s
    while loop.interactive.wait_left() is not None:
        loop.run_once(idle_wait=30)
    assert time.monotonic() - started < 10
    loop.close()


def test_calls_waiting_as_a_jobs_step_starts_share_it_and_each_side_ends_as_apart(tiny_model_dirs, tmp_path):
    """A forward_backward call waiting when a job's step starts goes through the base in that step (not a pass of
    its own): the step's tokens are both's, the step log accounts the model's job its tokens beside the job's,
    the job trains exactly as alone and the call returns exactly what the engine returns for it alone; a call too
    large for the step's room waits for a pass of its own. (The steps whose peak the memory model measures take
    no call; nor any with `interactive_in_steps: false`.)"""
    def run(with_calls: bool, in_steps: bool = True):
        base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
        data = write_task_data(tmp_path / "data", "a", rows=16)
        state = tmp_path / f"{with_calls}-{in_steps}"
        spec = run_spec(str(tiny_model_dirs["llama"]), state / "out", [job_dict("a", data, 6, max_seq_len=32)],
                        step_tokens=256)
        (submission,) = spec.submissions()
        loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=256,
                                               interactive_in_steps=in_steps), "trainer-0", state)
        loop.desk.open("model-job", "alice:train:0", 4, owner="alice", output_dir=str(tmp_path / "model"))
        loop.assign(assignment_for(submission, "a", base.tokenizer))

        def steps(count: int) -> list:
            done = []
            for _ in range(200):
                if len(done) == count:
                    break
                report = loop.run_once(idle_wait=0.05)
                if report is not None:
                    done.append(report)
            assert len(done) == count, (len(done), [r.step for r in done])
            return done

        reports = steps(4)   # the measured steps, then one more
        futures = []
        if with_calls:
            small = ModelCall(adapter_name("alice:train:0"), call_datums())
            large = ModelCall(adapter_name("alice:train:0"), tuple(call_datums()) * 8)   # 184 tokens: no room
            futures = [loop.interactive.submit("alice:train:0", 1, "forward_backward", small),
                       loop.interactive.submit("alice:train:0", 2, "forward_backward", large)]
        reports += steps(1)
        run_until_idle(loop)
        rows = [json.loads(line) for line in next(state.rglob("trainer*.jsonl")).read_text().splitlines()]
        loop.close()
        adapter = load_file(state / "out" / "a" / "adapter_model.safetensors")
        return reports, futures, rows, adapter

    alone_reports, _, _, alone = run(with_calls=False)
    reports, (small, large), rows, beside = run(with_calls=True)
    assert [r.call_tokens for r in reports[:4]] == [0, 0, 0, 0]
    fused = reports[4]
    assert fused.call_tokens == 9 + 14 and fused.tokens == alone_reports[4].tokens + 23
    assert [r.loss for r in fused.results] == [r.loss for r in alone_reports[4].results]
    row = next(r for r in rows if r.get("step") == fused.step and "job_tokens" in r and r.get("kind") is None)
    assert row["job_tokens"] == {"a": fused.results[0].tokens, "model-job": 23}
    assert any(r.get("kind") == "interactive" and r["tokens"] == 8 * 23 for r in rows)   # the large call's pass
    for name, tensor in alone.items():
        assert torch.equal(beside[name], tensor), name
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    InteractiveModel(base, "reference", 4)
    expected = run_calls(base, [ModelCall("reference", call_datums())], backward=True)[0]
    output = small.result(timeout=1)
    assert output.loss_sum == expected.loss_sum
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(output.logprobs, expected.logprobs, strict=True))
    assert large.result(timeout=1).loss_sum != 0
    # interactive_in_steps: false: the same calls in passes of their own, the same answer
    reports, (small, _), rows, _ = run(with_calls=True, in_steps=False)
    assert reports[4].call_tokens == 0 and reports[4].tokens == alone_reports[4].tokens
    assert any(r.get("kind") == "interactive" and r["tokens"] == 9 * 23 for r in rows)   # both calls, one pass
    assert small.result(timeout=1).loss_sum == expected.loss_sum


def test_beside_a_samplings_kv_cache_steps_and_calls_are_planned_with_it(tiny_model_dirs, tmp_path, monkeypatch):
    """While a sampling batch decodes in slices, its KV cache stays allocated: a job's step is admitted with those
    bytes counted (StepAdmission.fits' held_bytes), a call shares the step only where the tokens that fit beside
    them leave room (here none: it runs in a pass of its own, sized to fit), and the step's peak, which holds the
    cache, teaches the memory model nothing."""
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    data = write_task_data(tmp_path / "data", "a", rows=16)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                    [job_dict(name, data, 8, max_seq_len=32) for name in ("a", "b")], step_tokens=256)
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=256), "trainer-0", tmp_path / "s")
    loop.desk.open("model-job", "alice:train:0", 4, owner="alice", output_dir=str(tmp_path / "model"))
    for submission in spec.submissions():   # two jobs: a step's second is admitted by the memory plan (fits)
        loop.assign(assignment_for(submission, submission.job.name, base.tokenizer))
    from actors.service.trainer.step_admission import StepAdmission

    admitted, observed, planned = [], [], []
    cache = [0]   # a sampling batch's KV cache between its slices, once it has begun
    monkeypatch.setattr(loop.interactive, "sampling_bytes", lambda: cache[0])
    fits, observe = StepAdmission.fits, StepAdmission.observe
    monkeypatch.setattr(StepAdmission, "fits", lambda self, mbs, held=0: admitted.append(held) or fits(self, mbs, held))
    monkeypatch.setattr(StepAdmission, "observe", lambda self, *args: observed.append(cache[0]) or observe(self, *args))
    monkeypatch.setattr(StepAdmission, "pass_tokens", lambda self, held: planned.append(held) or 20)
    reports: list = []

    def step_until(done) -> None:
        for _ in range(300):
            if done():
                return
            report = loop.run_once(idle_wait=0.05)
            if report is not None:
                reports.append(report)
        raise AssertionError(f"{len(reports)} steps")

    step_until(lambda: len(reports) >= 4)   # the steps whose peak is measured take no call
    admitted.clear()
    cache[0] = 12345
    call = loop.interactive.submit("alice:train:0", 1, "forward_backward",
                                   ModelCall(adapter_name("alice:train:0"), call_datums()))   # 23 tokens
    step_until(lambda: call.done() and len(reports) >= 6)
    assert call.result(timeout=1).loss_sum != 0
    assert all(r.call_tokens == 0 for r in reports), "no room beside the cache: a pass of its own"
    assert admitted and set(admitted) == {12345} and set(planned) == {12345}
    assert observed and 12345 not in observed   # the steps before the cache taught it; none beside it
    assert loop.interactive.max_pass_tokens == 20   # its own pass sized to fit beside the cache
    loop.close()


def test_a_fused_step_that_fails_answers_its_calls_so_and_the_models_next_calls_still_run(tiny_model_dirs, tmp_path,
                                                                                          monkeypatch):
    """The step a call shares fails (here: its calls' loss raises, as an out-of-memory error would): the call's
    future says the fused step failed and why, the step's job fails with that reason, and the model's next call (an
    optimizer step) still runs: nothing of the model is lost or stuck."""
    import actors.engine.trainer as trainer_module

    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    data = write_task_data(tmp_path / "data", "a", rows=16)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, 8, max_seq_len=32)],
                    step_tokens=256)
    (submission,) = spec.submissions()
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=256), "trainer-0", tmp_path / "s")
    loop.desk.open("model-job", "alice:train:0", 4, owner="alice", output_dir=str(tmp_path / "model"))
    loop.assign(assignment_for(submission, "a", base.tokenizer))
    stepped = 0
    while stepped < 3:   # the measured steps take no call
        stepped += loop.run_once(idle_wait=0.05) is not None

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer_module, "call_losses", out_of_memory)
    call = loop.interactive.submit("alice:train:0", 1, "forward_backward",
                                   ModelCall(adapter_name("alice:train:0"), call_datums()))
    optim = loop.interactive.submit("alice:train:0", 2, "optim_step", AdamStep(learning_rate=0.01))
    events = run_until_idle(loop)
    deadline = time.monotonic() + 30
    while not optim.done() and time.monotonic() < deadline:   # the model's calls after the step's failure
        loop.run_once(idle_wait=0.05)
    with pytest.raises(RuntimeError, match=r"the fused step failed: RuntimeError\('CUDA out of memory \(simulated"):
        call.result(timeout=1)
    assert optim.result(timeout=5) is not None
    (failed,) = [e for e in events if e.kind == "failed"]
    assert failed.job_id == "a" and "CUDA out of memory (simulated)" in failed.data["reason"]
    loop.close()


def test_heartbeats_that_waited_out_a_long_step_keep_their_model_and_silence_still_ends_one(tiny_model_dirs, tmp_path):
    """A trainer actor takes its calls between passes, so the heartbeats sent while a long step runs reach it only
    after: the desk looks for silent models at a pass's start, before its step, not after it (where every model
    looked silent after a step longer than the heartbeat timeout, and was ended though its server beat throughout).
    A model whose server really stopped beating is still ended once the timeout has passed."""
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out",
                    [job_dict("a", write_task_data(tmp_path / "data", "a", rows=16), 4, max_seq_len=32)],
                    step_tokens=256)
    (submission,) = spec.submissions()
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=256,
                                           interactive_heartbeat_timeout_s=1.0), "trainer-0", tmp_path / "state")
    loop.desk.open("job-m", "alice:train:0", 4, owner="alice", output_dir=str(tmp_path / "m"), base_name="tiny")
    loop.assign(assignment_for(submission, "a", base.tokenizer))
    step = loop.steps.run

    def long_step(ready):   # a step longer than the heartbeat timeout
        time.sleep(1.3)
        return step(ready)

    loop.steps.run = long_step
    for _ in range(3):   # each pass: the beats that arrived while the last one ran, then a long step
        assert loop.desk.beat(["alice:train:0"]) == []
        loop.run_once(idle_wait=0)
        assert loop.desk.job_ids() == ["job-m"], [e.data.get("reason") for e in loop.drain_events()]
    loop.steps.run = step
    run_until_idle(loop)
    deadline = time.monotonic() + 5   # no beats any more: ended after the timeout, its final adapter written
    while loop.desk.job_ids() and time.monotonic() < deadline:
        loop.run_once(idle_wait=0.1)
    assert loop.desk.job_ids() == []
    loop.close()
