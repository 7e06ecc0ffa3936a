"""A trainer's desk for its interactive models (actors/service/trainer/interactive_desk.py), Ray-free: a model's
calls are taken at once and their outcomes kept for the front that sent them; a pass is a row of the step log
and a step event charging the model's job its tokens, an optimizer step the job's progress and, every
`checkpoint_every` steps, a checkpoint whose seq_id the outcome carries; a model created again from that
checkpoint (its trainer lost) has exactly the weights and optimizer state it had; a model whose front stopped
beating ends after the timeout with its final adapter written and its job completed."""

from __future__ import annotations

import time

import pytest
import torch

from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.interactive_model import AdamStep
from actors.engine.interactive_step import CallDatum, ModelCall
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name
from actors.service.trainer.interactive_desk import InteractiveDesk
from actors.service.trainer.trainer_reports import TrainerEvents
from tests.helpers.models import VOCAB, tiny_model

pytestmark = pytest.mark.unit

MODEL = "s1:train:0"


def desk_of(rows: list) -> tuple[InteractiveDesk, TrainerEvents]:
    events = TrainerEvents()
    calls = InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=0)
    return InteractiveDesk(calls, events, "trainer-0", rows.append, checkpoint_every=2, heartbeat_timeout_s=10), events


def fb(seed: int) -> ModelCall:
    generator = torch.Generator().manual_seed(seed)
    datums = tuple(CallDatum(tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist()),
                             {"target_tokens": torch.randint(0, VOCAB, (n,), generator=generator),
                              "weights": torch.ones(n)}) for n in (7, 12))
    return ModelCall(adapter_name(MODEL), datums)


def run(desk: InteractiveDesk) -> None:
    while desk.calls.step():
        pass


def test_calls_outcomes_progress_checkpoints_and_resuming_from_one(tmp_path):
    rows: list = []
    desk, events = desk_of(rows)
    desk.open("job-1", MODEL, 4, owner="alice", seed=3, output_dir=str(tmp_path), base_name="tiny")
    keys = []
    for step in range(3):
        keys.append(desk.submit("front-a", MODEL, 2 * step + 1, "forward_backward", fb(step)))
        keys.append(desk.submit("front-a", MODEL, 2 * step + 2, "optim_step", AdamStep(learning_rate=0.05)))
        run(desk)
        if step == 1:   # the state a checkpoint after this step holds
            weights = {name: tensor.clone() for name, tensor in adapter_state_dict(desk.calls.models[MODEL].model
                                                                                   .adapter).items()}
            optimizer = {name: t.clone() for name, t in desk.calls.models[MODEL].model.optimizer_tensors().items()}
    assert desk.take("front-b") == []
    outcomes = {outcome.key: outcome for outcome in desk.take("front-a")}
    assert set(outcomes) == set(keys) and all(outcome.error is None for outcome in outcomes.values())
    assert [outcomes[key].checkpoint_seq for key in keys] == [None, None, None, 4, None, None]
    happened = desk.events.drain()
    tokens = 7 + 12
    passes = [e for e in happened if e.kind == "step"]
    assert [e.data["job_tokens"] for e in passes] == [{"job-1": tokens}] * 3
    assert [row["kind"] for row in rows] == ["interactive"] * 3 and rows[0]["jobs"] == ["job-1"]
    progress = [e for e in happened if e.kind == "progress"]
    assert [(e.step, e.data["tokens"]) for e in progress] == [(1, tokens), (2, tokens), (3, tokens)]
    assert [e.data["lr"] for e in progress] == [0.05] * 3   # each optimizer step's own learning rate
    assert [(e.kind, e.step) for e in happened if e.kind == "checkpoint"] == [("checkpoint", 2)]

    again, _ = desk_of([])   # its trainer lost: a new one, a fresh base
    assert again.open("job-1", MODEL, 4, owner="alice", output_dir=str(tmp_path), base_name="tiny",
                      resume=True) == 4
    resumed = again.calls.models[MODEL]
    assert resumed.next_seq == 5 and resumed.model.steps == 2
    for name, tensor in adapter_state_dict(resumed.model.adapter).items():
        assert torch.equal(tensor, weights[name]), name
    for name, tensor in resumed.model.optimizer_tensors().items():
        assert torch.equal(tensor, optimizer[name]), name


def test_a_model_whose_front_stopped_beating_ends_with_its_final_adapter(tmp_path):
    desk, events = desk_of([])
    desk.open("job-1", MODEL, 4, owner="alice", output_dir=str(tmp_path), base_name="tiny")
    desk.submit("front-a", MODEL, 1, "forward_backward", fb(1))
    assert desk.beat([MODEL, "s9:train:0"]) == ["s9:train:0"]
    now = time.monotonic()
    assert desk.reap(now + 5) == []
    assert desk.reap(now + 11) == [MODEL] and desk.job_ids() == []
    run(desk)   # its last call, then the final save
    ended = [e for e in events.drain() if e.kind in ("completed", "failed")]
    assert [(e.kind, e.job_id) for e in ended] == [("completed", "job-1")]
    assert "stopped beating" in ended[0].data["reason"] and ended[0].data["adapter_dir"] == str(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file() and desk.calls.rank_of(MODEL) is None


def test_a_sampling_call_cancelled_before_it_runs_is_never_sampled_and_says_so(monkeypatch):
    """The front's cancel (its client abandoned the sample: cancel_future) drops the call before the trainer's
    next batch; the other call of that batch is sampled, and a call that already ran cannot be cancelled."""
    from actors.engine.tinker_sampling import SampleCall
    from actors.service.trainer import interactive_passes

    sampled: list[int] = []
    real = interactive_passes.SampleRun

    def counting(base, calls, decode):
        sampled.append(len(calls))
        return real(base, calls, decode)

    monkeypatch.setattr(interactive_passes, "SampleRun", counting)
    desk, _ = desk_of([])
    doomed = desk.sample("front-a", SampleCall(None, (5, 6, 7), max_tokens=4, temperature=0.0))
    kept = desk.sample("front-a", SampleCall(None, (8, 9), max_tokens=4, temperature=0.0))
    assert desk.cancel(doomed)
    run(desk)
    outcomes = {outcome.key: outcome for outcome in desk.take("front-a")}
    assert sampled == [1], "one call in the batch: the cancelled one was never sampled"
    assert outcomes[doomed].error == "cancelled by its client before it ran" and outcomes[doomed].category == "user"
    assert outcomes[kept].error is None and len(outcomes[kept].value.sequences[0].tokens) == 4
    assert not desk.cancel(kept), "a call that ran is not cancelled"
    assert desk.keys.samples == {}, "nothing kept of the calls that ended"


def test_the_same_call_sent_twice_runs_once_under_one_key_and_is_counted_once(tmp_path):
    """A front's request it stopped waiting for, sent again (or a restarted front's): the same (model, seq_id) is
    the same call: one key, one outcome, one optimizer step of the job's progress (it was two keys, and the step
    counted twice)."""
    desk, events = desk_of([])
    desk.open("job-1", MODEL, 4, owner="alice", output_dir=str(tmp_path), base_name="tiny")
    keys = [desk.submit("front-a", MODEL, 1, "forward_backward", fb(1)) for _ in range(2)]
    steps = [desk.submit("front-a", MODEL, 2, "optim_step", AdamStep(learning_rate=0.05)) for _ in range(2)]
    assert keys[0] == keys[1] and steps[0] == steps[1]
    run(desk)
    assert sorted(outcome.key for outcome in desk.take("front-a")) == sorted({keys[0], steps[0]})
    assert [e.step for e in events.drain() if e.kind == "progress"] == [1]


def test_calls_of_a_model_its_trainer_refused_to_create_say_why(tmp_path):
    """A model's creation queued behind a long pass (the service answered its front meanwhile) that the trainer then
    refuses: the calls sent after it fail naming the refusal, not a bare "no model"."""
    desk, _ = desk_of([])
    with pytest.raises(ValueError, match="nothing to train") as refused:
        desk.open("job-1", MODEL, 4, owner="alice", train_attn=False, train_mlp=False, output_dir=str(tmp_path))
    with pytest.raises(KeyError) as failed:
        desk.submit("front-a", MODEL, 1, "forward_backward", fb(1))
    assert failed.value.args[0] == f"model {MODEL} was never created on trainer trainer-0: {refused.value}"
    with pytest.raises(KeyError, match="^'no model other'"):   # a model never opened: as before
        desk.submit("front-a", "other", 1, "forward_backward", fb(1))


def test_a_gone_fronts_outcomes_are_dropped_and_a_live_ones_kept(caplog):
    """Outcomes wait on the trainer for the front (an HTTP server) that sent their calls until it takes them: a killed
    server's stayed in the trainer's memory for good (a sample's whole result each). Those of a front that has not
    taken any for FRONT_GONE_S are dropped at the next reap, saying so; a front that takes keeps its own."""
    from actors.engine.tinker_sampling import SampleCall
    from actors.service.trainer import interactive_desk

    desk, _ = desk_of([])
    call = SampleCall(None, (5, 6, 7), max_tokens=3, temperature=0.0)
    desk.sample("front-gone", call)
    desk.sample("front-live", call)
    run(desk)
    desk.reap(now=time.monotonic() - 2 * interactive_desk.FRONT_GONE_S)   # both fronts first seen that long ago
    assert len(desk.take("front-live")) == 1   # (a clock, not a sleep: a loaded machine's slow step aged both)
    kept = desk.sample("front-live", call)
    run(desk)
    desk.reap()
    assert desk.take("front-gone") == [] and [outcome.key for outcome in desk.take("front-live")] == [kept]
    assert "dropped 1 outcomes of front-gone, which has not taken them" in caplog.text
