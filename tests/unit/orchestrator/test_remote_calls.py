"""The Tinker front's calls on a service's trainer (orchestrator/tinker/remote_calls.py) against a real trainer's
desk (actors/service/trainer/interactive_desk.py, Ray-free): the service's calls are the desk's methods.

A trainer runs a call as soon as it has it, so a call's outcome can be ready, and taken by the poller that
another waiting call keeps running, before the front has the new call's key back: the outcome must still reach
its call (it was dropped, and two users' loops on one trainer hung on an `optim_step` that had run)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.engine.interactive_model import AdamStep
from actors.engine.interactive_step import CallDatum, ModelCall
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name
from actors.service.trainer.interactive_desk import InteractiveDesk
from actors.service.trainer.trainer_reports import TrainerEvents
from orchestrator.tinker.remote_calls import RemoteCalls
from tests.helpers.models import VOCAB, tiny_model

pytestmark = pytest.mark.unit

ALICE, BOB = "s1:train:0", "s2:train:0"


def fb(model_id: str, seed: int) -> ModelCall:
    generator = torch.Generator().manual_seed(seed)
    datums = tuple(CallDatum(tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist()),
                             {"target_tokens": torch.randint(0, VOCAB, (n,), generator=generator),
                              "weights": torch.ones(n)}) for n in (5, 9))
    return ModelCall(adapter_name(model_id), datums)


class Service:
    """`call(method, *args)` as the service answers it, on one trainer's desk run by this test. `hold`: model
    ids whose `tinker.submit` returns its key only after the call ran and the front's poller took its outcome."""

    def __init__(self, desk: InteractiveDesk):
        self.desk = desk
        self.hold: set[str] = set()

    def __call__(self, method: str, *args):
        if method == "tinker.open":
            model_id, _base, rank, owner, seed, *_ = args
            self.desk.open(f"job-{model_id}", model_id, rank, owner=owner, seed=seed)
            return {"job": f"job-{model_id}", "trainer": "trainer-0", "output_dir": ""}
        if method == "tinker.take":
            return self.desk.take(args[1])
        if method == "tinker.submit":
            _trainer, front, model_id, seq_id, kind, payload, *_token = args
            key = self.desk.submit(front, model_id, seq_id, kind, payload)
            if model_id in self.hold:
                while self.desk.calls.step():
                    pass
                deadline = time.monotonic() + 30
                while self.desk.outcomes.get(front) and time.monotonic() < deadline:
                    time.sleep(0.01)   # the poller takes it
                assert not self.desk.outcomes.get(front), "the poller never took the outcome"
            return key
        if method == "tinker.sample":
            return self.desk.sample(args[1], args[2])
        if method == "tinker.cancel":
            return self.desk.cancel(args[1])
        raise AssertionError(f"unexpected service call {method}{args}")


def test_an_outcome_taken_before_its_key_came_back_reaches_its_call():
    desk = InteractiveDesk(InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=0),
                           TrainerEvents(), "trainer-0", lambda row: None)
    service = Service(desk)
    front = RemoteCalls(service, front="front-a")
    try:
        for model_id in (ALICE, BOB):
            front.create_model(model_id, 4, owner=model_id, base_model="tiny")
        # alice's second call first: it waits for her first, and keeps the trainer's poller running meanwhile
        alice_second = front.submit(ALICE, 2, "optim_step", AdamStep(learning_rate=0.01))
        service.hold.add(BOB)
        bob_pass = front.submit(BOB, 1, "forward_backward", fb(BOB, 1))
        assert bob_pass.result(timeout=30).loss_sum > 0
        bob_step = front.submit(BOB, 2, "optim_step", AdamStep(learning_rate=0.01))
        assert bob_step.result(timeout=30) is not None

        service.hold.clear()
        alice_first = front.submit(ALICE, 1, "forward_backward", fb(ALICE, 2))
        stepping = threading.Thread(target=lambda: [desk.calls.step() for _ in range(4)])
        stepping.start()
        stepping.join(timeout=60)
        assert alice_first.result(timeout=30).loss_sum > 0
        assert alice_second.result(timeout=30) is not None
        assert not any(front.early.values())   # nothing left unclaimed
    finally:
        front.close()


def test_a_sample_cancelled_at_the_front_is_cancelled_on_its_trainer(monkeypatch):
    """The front's cancel (its client abandoned the sample) reaches the trainer's desk: the call is never
    sampled there, and its outcome, which still comes back, finds its future done and changes nothing."""
    from actors.engine.tinker_sampling import SampleCall
    from actors.service.trainer import interactive_passes

    sampled: list[int] = []
    monkeypatch.setattr(interactive_passes, "SampleRun", lambda base, calls, decode: sampled.append(len(calls)))
    desk = InteractiveDesk(InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=0),
                           TrainerEvents(), "trainer-0", lambda row: None)
    front = RemoteCalls(Service(desk), front="front-a")
    try:
        future = front.submit_sample(SampleCall(None, (5, 6), max_tokens=3), trainer="trainer-0")
        assert future.cancel()   # as the sessions' cancel does, then the calls' own
        front.cancel(future)
        while desk.calls.step():
            pass
        assert sampled == [], "the trainer never sampled it"
        deadline = time.monotonic() + 30
        while desk.outcomes.get("front-a") or front.waiting.get("trainer-0"):
            assert time.monotonic() < deadline, "the cancelled call's outcome was never taken"
            time.sleep(0.01)
        assert future.cancelled()
    finally:
        front.close()


def test_a_send_answered_busy_then_passing_asks_again_under_one_token_and_a_refusal_ends_it(monkeypatch):
    """A call to a busy trainer is kept and asked for again under the same token once the service says its kept
    request has an answer (`tinker.ready`), through a passing 503 (the service's link), until its key comes back; a
    refusal after a busy answer reaches the call's own handler; a refusal on the first try is raised to the route."""
    from fastapi import HTTPException

    from orchestrator.tinker import patient_sends
    from orchestrator.tinker.patient_sends import PatientSends
    from orchestrator.tinker.tinker_service import BUSY_HEADER

    monkeypatch.setattr(patient_sends, "RETRY_EVERY_S", 0.01)
    busy = HTTPException(503, "busy", headers={BUSY_HEADER: "trainer-0"})
    answers = [busy, HTTPException(503, "the link restarted"), busy, "key-7"]
    tokens, done = [], threading.Event()
    got: list = []

    def call(method, *args):
        if method == "tinker.ready":
            return list(args[0])
        tokens.append(args[-1])
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    sends = PatientSends(call)
    try:
        sends.send("tinker.sample", ("trainer-0", "front-a", "call"), lambda key: (got.append(key), done.set()),
                   lambda error: (got.append(error), done.set()))
        assert done.wait(10) and got == ["key-7"] and len(set(tokens)) == 1 and len(tokens) == 4
        answers[:] = [busy, HTTPException(404, "no model")]
        done.clear()
        sends.send("tinker.submit", ("trainer-0",), got.append, lambda error: (got.append(error.detail), done.set()))
        assert done.wait(10) and got[-1] == "no model"
        answers[:] = [HTTPException(422, "bad payload")]
        with pytest.raises(HTTPException, match="bad payload"):
            sends.send("tinker.submit", ("trainer-0",), got.append, got.append)
    finally:
        sends.close()


def test_hundreds_of_calls_on_a_busy_trainer_wait_in_one_thread_and_one_request_at_a_time(monkeypatch):
    """An RL loop's hundreds of samples sent while their trainer is in a long pass: the front waits for all of them
    with one thread and one `tinker.ready` request at a time (it held a thread each, and each of its asks held one of
    the HTTP bridge's 16 threads for 10 s), and once the pass ends each gets its own key, each asked for once more.
    A trainer busy past `BUSY_LIMIT_S` fails the calls still waiting, saying so."""
    from fastapi import HTTPException

    from orchestrator.tinker import patient_sends
    from orchestrator.tinker.patient_sends import PatientSends
    from orchestrator.tinker.tinker_service import BUSY_HEADER

    count = 300
    passing = threading.Event()      # the trainer's pass: set while it runs
    passing.set()
    lock = threading.Lock()
    asks: dict[str, int] = {}
    readies: list[int] = []
    in_ready = [0, 0]                # now, most at once

    def call(method, *args):
        if method == "tinker.ready":
            with lock:
                in_ready[0] += 1
                in_ready[1] = max(in_ready)
            try:
                readies.append(len(args[0]))
                time.sleep(0.02)     # the service's wait
                return [] if passing.is_set() else list(args[0])
            finally:
                with lock:
                    in_ready[0] -= 1
        token = args[-1]
        with lock:
            asks[token] = asks.get(token, 0) + 1
        if passing.is_set():
            raise HTTPException(503, "trainer-0 is busy", headers={BUSY_HEADER: "trainer-0"})
        return f"key-{args[2]}"

    sends = PatientSends(call)
    got: dict[int, object] = {}
    all_in = threading.Event()
    threads_before = threading.active_count()
    try:
        for n in range(count):
            sends.send("tinker.sample", ("trainer-0", "front-a", n),
                       lambda key, n=n: (got.__setitem__(n, key), len(got) == count and all_in.set()),
                       lambda error, n=n: got.__setitem__(n, error))
        time.sleep(0.2)
        assert threading.active_count() <= threads_before + 1, "one waiting thread, whatever the number of calls"
        assert got == {} and max(readies) == count and in_ready[1] == 1
        passing.clear()              # the pass ends
        assert all_in.wait(30), f"{count - len(got)} calls never answered"
        assert got == {n: f"key-{n}" for n in range(count)}
        assert sorted(set(asks.values())) == [2], "each call sent once, then asked for once when answered"

        monkeypatch.setattr(patient_sends, "BUSY_LIMIT_S", 0.1)
        passing.set()
        failed = threading.Event()
        errors: list = []
        sends.send("tinker.sample", ("trainer-0", "front-a", "stuck"), errors.append,
                   lambda error: (errors.append(error), failed.set()))
        assert failed.wait(10)
        assert errors[0].status_code == 503 and "taken as stuck" in errors[0].detail
        assert sends.kept == {}
    finally:
        sends.close()


class HeldTakes(Service):
    """As `Service`, but the front's poller takes no outcome until `taking` is set: an outcome made on the trainer
    stays there, as one does while its answer is on its way back."""

    def __init__(self, desk: InteractiveDesk):
        super().__init__(desk)
        self.taking = threading.Event()

    def __call__(self, method: str, *args):
        if method == "tinker.take":
            self.taking.wait(30)
        return super().__call__(method, *args)


@pytest.mark.parametrize("started", [False, True])
def test_a_cancelled_sample_is_told_cancelled_before_it_ran_or_while_it_ran_as_it_was(monkeypatch, started):
    """A client's cancel (the Sessions' cancel, with the front's on its trainer, as the cancel_future route calls
    it) of a sample its trainer has not started: never sampled, "cancelled before it ran"; of one it has sampled:
    it ran to its end there, and the answer says so, its result dropped (it said "before it ran" too)."""
    import asyncio

    from actors.engine.tinker_sampling import SampleCall
    from actors.service.trainer import interactive_passes
    from orchestrator.tinker.sessions import Cancelled, Sessions

    sampled: list[int] = []
    real = interactive_passes.SampleRun
    monkeypatch.setattr(interactive_passes, "SampleRun",
                        lambda base, calls, decode: sampled.append(len(calls)) or real(base, calls, decode))
    desk = InteractiveDesk(InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=0),
                           TrainerEvents(), "trainer-0", lambda row: None)
    service = HeldTakes(desk)
    front = RemoteCalls(service, front="front-a")
    sessions = Sessions()
    try:
        future = front.submit_sample(SampleCall(None, (5, 6), max_tokens=3), trainer="trainer-0")
        request_id = sessions.accept(future, "alice", lambda result: {}, cancellable=True)
        deadline = time.monotonic() + 30
        while getattr(future, "aspen_on", None) is None:   # on its trainer
            assert time.monotonic() < deadline, "the sample never reached its trainer"
            time.sleep(0.01)
        if started:
            while desk.calls.step():
                pass
            assert sampled == [1] and desk.outcomes.get("front-a"), "sampled there, its outcome not taken yet"
        sessions.cancel(request_id, "alice", front.cancel)
        service.taking.set()
        while desk.calls.step():
            pass
        status, answer = asyncio.run(sessions.retrieve(request_id, "alice", wait_s=1))
        assert status == "failed" and isinstance(answer, Cancelled)
        if started:
            assert str(answer) == (f"request {request_id} was cancelled (cancel_future) while it ran on its trainer: "
                                   "it ran to its end there, and its answer was dropped")
        else:
            assert str(answer) == f"request {request_id} was cancelled (cancel_future) before it ran"
            assert sampled == [], "never sampled"
    finally:
        service.taking.set()
        front.close()


@pytest.mark.parametrize("said", ["five minutes", "-1", "nan"])
def test_a_bad_recover_for_setting_stops_the_front_at_its_start_saying_what_to_give(monkeypatch, said):
    monkeypatch.setenv("ASPEN_TINKER_RECOVER_FOR_S", said)
    with pytest.raises(ValueError, match=rf"ASPEN_TINKER_RECOVER_FOR_S='{said}': give the seconds .* 0 or more"):
        RemoteCalls(lambda *args: None, front="front-a")
    monkeypatch.setenv("ASPEN_TINKER_RECOVER_FOR_S", " 12.5 ")
    assert RemoteCalls(lambda *args: None, front="front-a").recover_for_s == 12.5
