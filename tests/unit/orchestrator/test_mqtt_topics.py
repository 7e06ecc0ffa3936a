"""What the service publishes on MQTT, checked without a broker against the contract that subscribers read
(orchestrator/mqtt/topics.py's docstring, docs/monitoring.md): each job's state retained at QoS 1 on
`jobs/<job>/state`, progress and notable events at QoS 1 on `jobs/<job>/progress|events`, each payload
numbered (`publisher`, `seq`), a retained state cleared as MQTT clears one (a zero-length retained message)
when the job is deleted and once a finished job's retention ran out, each once; and the outbox between the
scheduler and the connection: bounded, never blocking, keeping its messages in order while the broker is
away, dropping its oldest non-retained one when full with a rate-limited warning, remembering clearings.
tests/servers/test_mqtt_events.py checks the same against real brokers."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest

from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent
from orchestrator.mqtt.outbox import Outbox
from orchestrator.mqtt.topics import EventTopics, Message, topic_prefix

PREFIX = "lab/v1"


def record(job_id: str, state: str, *, finished_at: float | None = None, step: int = 3) -> JobRecord:
    now = time.time()
    return JobRecord(id=job_id, name=f"name-{job_id}", state=state, reason="why", base_model="m",
                     quantization="none", priority=0, output_dir="/out", trainer="trainer-0", step=step,
                     total_steps=10, tokens=300, loss=1.5, eval_loss=None, tokens_per_s=20.0, checkpoint_step=None,
                     adapter_dir=None, submitted_at=now, started_at=now, finished_at=finished_at,
                     updated_at=finished_at or now)


def payload(message: Message) -> dict | None:
    return json.loads(message.payload) if message.payload else None


def test_a_state_change_is_retained_on_the_jobs_state_topic():
    topics = EventTopics(PREFIX, retain_finished_s=None, service_info={"policy": "fifo"})
    [state] = topics.job_changed(record("job-1", "running"), "queued")
    assert (state.topic, state.qos, state.retain) == ("lab/v1/jobs/job-1/state", 1, True)
    data = payload(state)
    assert {key: data[key] for key in ("job", "name", "state", "previous", "step", "total_steps", "loss")} == {
        "job": "job-1", "name": "name-job-1", "state": "running", "previous": "queued", "step": 3, "total_steps": 10,
        "loss": 1.5}
    assert data["eval_score"] is None
    assert (data["publisher"], data["seq"]) == (topics.publisher, 1)
    assert [m.payload for m in topics.retained_states()] == [state.payload]   # its seq again: a repeat
    [scored] = topics.job_changed(dataclasses.replace(record("job-1", "running"), eval_score=0.5), "running")
    assert payload(scored)["eval_score"] == 0.5
    # an early stop and a failure are also events, not retained
    for ending in ("stopped_early", "failed"):
        _, event = topics.job_changed(record("job-1", ending, finished_at=time.time()), "running")
        assert (event.topic, event.qos, event.retain) == ("lab/v1/jobs/job-1/events", 1, False)
        assert (payload(event)["kind"], payload(event)["reason"]) == (ending, "why")
    assert len(topics.job_changed(record("job-1", "completed", finished_at=time.time()), "running")) == 1
    status = json.loads(topics.status("offline", reason="shutdown"))
    assert (status["state"], status["reason"], status["policy"]) == ("offline", "shutdown", "fifo")
    assert status["seq"] > payload(scored)["seq"] and status["publisher"] == topics.publisher
    will, again = json.loads(topics.last_will()), json.loads(topics.last_will())   # one per connection
    assert (will["state"], will["reason"], will["publisher"]) == ("offline", "connection lost", topics.publisher)
    assert again["seq"] == will["seq"] + 1
    assert EventTopics(PREFIX, retain_finished_s=None).publisher != topics.publisher   # new at each start
    assert topics.status_topic == "lab/v1/service/status"


def test_progress_predictions_evaluations_and_decisions():
    topics = EventTopics(PREFIX, retain_finished_s=None)
    events = [TrainerEvent(kind="progress", job_id="a/b", step=4, data={"loss": 2.0, "tokens_per_s": 50.0,
                                                                        "tokens": 64, "total_steps": 9,
                                                  "lr": 1e-3}, time=12.5),
              TrainerEvent(kind="prediction", job_id="a/b", step=4, data={"predicted_stop_step": 7}),
              TrainerEvent(kind="eval", job_id="a/b", step=4, data={"eval_loss": 1.25}),
              TrainerEvent(kind="eval", job_id="a/b", step=6, data={"eval_loss": 1.2, "eval_score": 0.75}),
              TrainerEvent(kind="checkpoint", job_id="a/b", step=4, data={}), TrainerEvent(kind="step", job_id="",
                                                                                           step=4, data={})]
    progress, prediction, evaluation, scored = topics.trainer_polled(events)
    assert (progress.topic, progress.qos, progress.retain) == ("lab/v1/jobs/a_b/progress", 1, False)
    assert payload(progress) == {"job": "a/b", "step": 4, "loss": 2.0, "tokens_per_s": 50.0, "tokens": 64,
                                 "total_steps": 9, "lr": 1e-3, "time": 12.5, "publisher": topics.publisher,
                                 "seq": 1}
    assert [payload(m)["seq"] for m in (prediction, evaluation, scored)] == [2, 3, 4]
    assert (prediction.topic, payload(prediction)["kind"], payload(prediction)["predicted_stop_step"]) == (
        "lab/v1/jobs/a_b/events", "prediction", 7)
    assert (payload(evaluation)["kind"], payload(evaluation)["eval_loss"]) == ("eval", 1.25)
    assert "eval_score" not in payload(evaluation)   # a job without a generation metric
    assert (payload(scored)["eval_loss"], payload(scored)["eval_score"]) == (1.2, 0.75)
    [preempted] = topics.decided("preempt", "job-1", "a higher priority job")
    [moved] = topics.decided("move", "job-1", "to trainer-1")
    assert [payload(m)["kind"] for m in (preempted, moved)] == ["preempted", "moved"]
    assert topics.decided("wait_memory", "job-1", "no room") == []


def test_a_deleted_job_is_cleared_once_and_not_published_again():
    topics = EventTopics(PREFIX, retain_finished_s=None)
    topics.job_changed(record("kept", "running"), "queued")
    topics.job_changed(record("gone", "completed", finished_at=time.time()), "running")
    [clearing] = topics.job_deleted("gone")
    assert (clearing.topic, clearing.payload, clearing.qos, clearing.retain) == ("lab/v1/jobs/gone/state", b"", 1, True)
    assert clearing.clears == "gone"
    assert [m.topic for m in topics.retained_states()] == ["lab/v1/jobs/kept/state"]
    assert [m.clears for m in topics.retained_states()] == [None]


def test_finished_states_are_cleared_once_after_their_retention():
    topics = EventTopics(PREFIX, retain_finished_s=100.0)
    finished = time.time()
    running, done = record("run", "running"), record("done", "completed", finished_at=finished)
    topics.job_changed(running, "queued")
    topics.job_changed(done, "running")
    assert topics.tick([running], clear_unknown=True, now=finished + 99) == []
    [clearing] = topics.tick([running], clear_unknown=True, now=finished + 101)
    assert clearing.clears == "done"
    assert topics.tick([running], clear_unknown=True, now=finished + 1000) == []     # once
    assert [m.topic for m in topics.retained_states()] == ["lab/v1/jobs/run/state"]

    # published again with a later finish: the earlier schedule no longer counts
    again = record("again", "failed", finished_at=finished)
    topics.job_changed(again, "running")
    later = record("again", "failed", finished_at=finished + 50)
    topics.job_changed(later, "failed")
    assert topics.tick([], clear_unknown=True, now=finished + 101) == []
    assert [m.clears for m in topics.tick([], clear_unknown=True, now=finished + 151)] == ["again"]

    kept = EventTopics(PREFIX, retain_finished_s=None)    # null keeps finished states
    kept.job_changed(done, "running")
    assert kept.tick([], clear_unknown=True, now=finished + 10**9) == []


def test_the_first_round_publishes_unknown_jobs_and_clears_long_finished_ones():
    now = time.time()
    jobs = [record("queued", "queued"), record("recent", "completed", finished_at=now - 10),
            record("old", "failed", finished_at=now - 3600)]
    external = EventTopics(PREFIX, retain_finished_s=60.0)
    messages = external.tick(jobs, clear_unknown=True, now=now)
    states = {m.state_of: payload(m) for m in messages if m.topic.endswith("/state")}
    assert states["queued"]["state"] == "queued" and states["recent"]["state"] == "completed"
    assert states["old"] is None                                  # an external broker may hold it: cleared
    assert external.tick(jobs[:1], clear_unknown=True, now=now) == []   # later rounds: the unfinished, known now

    embedded = EventTopics(PREFIX, retain_finished_s=60.0)       # a fresh broker holds nothing to clear
    assert {m.state_of for m in embedded.tick(jobs, clear_unknown=False, now=now)} == {"queued", "recent"}


def test_topic_prefixes_and_levels():
    assert topic_prefix("/lab/aspen/") == "lab/aspen"
    for wrong in ("", "/", "aspen/#", "aspen/+/v1"):
        with pytest.raises(ValueError, match="events.topic_prefix"):
            topic_prefix(wrong)
    topics = EventTopics("p", retain_finished_s=None)
    assert topics.job_topic("x/+#-00ff", "state") == "p/jobs/x___-00ff/state"


def test_the_outbox_keeps_its_messages_in_order_while_down_and_drops_the_oldest_non_retained_when_full(caplog):
    topics = EventTopics(PREFIX, retain_finished_s=None)
    outbox = Outbox(4, "mqtt://broker:1883")
    outbox.down = True                                   # the broker is away: the messages wait
    [state] = topics.job_changed(record("job-1", "running"), "queued")
    progress = [topics.trainer_polled([TrainerEvent(kind="progress", job_id="job-1", step=step, data={})])[0]
                for step in (1, 2, 3)]
    [event] = topics.decided("preempt", "job-1", "why")
    [later] = topics.decided("move", "job-1", "why")
    with caplog.at_level(logging.WARNING):
        assert all(outbox.put(m) for m in (state, progress[0], event, progress[1])) and len(outbox) == 4
        assert outbox.dropped_total == 0
        assert outbox.put(later) and len(outbox) == 4    # full: the oldest non-retained (progress 1) goes
        assert outbox.put(progress[2])                   # then the preemption: the retained state stays
        assert outbox.dropped_total == 2
    assert list(outbox.queue) == [state, progress[1], later, progress[2]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings                 # rate-limited: not one per message
    assert "dropped 1 MQTT event(s)" in warnings[0] and "the queue is full" in warnings[0], warnings
    assert "mqtt://broker:1883" in warnings[0] and "keeps the last 4 messages while the broker is away" in warnings[0]
    assert outbox.take() is state
    outbox.give_back(state)                              # its publishing cut short: first again
    assert [outbox.take() for _ in range(5)] == [state, progress[1], later, progress[2], None]
    retained_only = Outbox(2, "the embedded broker")
    states = [topics.job_changed(record(f"job-{n}", "running"), "queued")[0] for n in range(3)]
    assert all(retained_only.put(m) for m in states)     # all retained: the oldest goes
    assert list(retained_only.queue) == states[1:] and retained_only.dropped_total == 1
    assert retained_only.queued_states() == {"job-1", "job-2"}
    outbox.closed = True
    assert outbox.put(event) is False and len(outbox) == 0


def test_the_outbox_remembers_clearings_until_they_are_published():
    topics = EventTopics(PREFIX, retain_finished_s=None)
    outbox = Outbox(1, "the embedded broker")
    [clearing] = topics.job_deleted("gone")
    [other] = topics.job_changed(record("other", "running"), "queued")
    assert outbox.put(clearing) and outbox.put(other)    # full of retained messages: the clearing is dropped
    assert list(outbox.queue) == [other]
    assert outbox.pending_clears() == ["gone"]           # sent again at the next connect
    outbox = Outbox(10, "the embedded broker")
    outbox.unsent_clears = {"gone"}
    [queued] = topics.job_deleted("queued-clear")
    assert outbox.put(queued)
    assert outbox.pending_clears() == ["gone"]           # a queued one goes out in turn
    assert outbox.queued_states() == {"queued-clear"}    # its last state is not published again before it
    for message in topics.clearing("gone"):
        outbox.published(message)
    assert outbox.pending_clears() == [] and outbox.unsent_clears == {"queued-clear"}
    # a newer state of the job supersedes its unsent clearing
    [state] = topics.job_changed(record("queued-clear", "queued"), None)
    outbox.put(state)
    assert outbox.unsent_clears == set()


def test_a_users_job_goes_to_the_service_topic_and_the_users_own_and_is_cleared_on_both():
    from dataclasses import replace

    topics = EventTopics(PREFIX, retain_finished_s=None)
    states = topics.job_changed(replace(record("job-u", "running"), user="alice"), "queued")
    assert [(m.topic, m.retain, m.qos) for m in states] == [(f"{PREFIX}/jobs/job-u/state", True, 1),
                                                         (f"{PREFIX}/users/alice/jobs/job-u/state", True, 1)]
    assert states[0].payload == states[1].payload
    progress = topics.trainer_polled([TrainerEvent(kind="progress", job_id="job-u", step=4, data={"loss": 1.0})])
    assert [m.topic for m in progress] == [f"{PREFIX}/jobs/job-u/progress", f"{PREFIX}/users/alice/jobs/job-u/progress"]
    assert [m.topic for m in topics.decided("preempt", "job-u", "why")] == [
        f"{PREFIX}/jobs/job-u/events", f"{PREFIX}/users/alice/jobs/job-u/events"]
    assert [m.topic for m in topics.retained_states()] == [m.topic for m in states]
    cleared = topics.job_deleted("job-u")
    assert [(m.topic, m.payload, m.clears) for m in cleared] == [(m.topic, b"", "job-u") for m in states]
    [operator] = topics.job_changed(record("job-o", "running"), "queued")   # an operator's job: one topic
    assert operator.topic == f"{PREFIX}/jobs/job-o/state"


def test_aspen_watch_events_tells_the_services_repeats_by_their_seq():
    from orchestrator.watch import Repeats

    topics = EventTopics(PREFIX, retain_finished_s=None)
    [running] = topics.job_changed(record("job-1", "running"), "queued")
    [event] = topics.decided("preempt", "job-1", "why")
    [completed] = topics.job_changed(record("job-1", "completed", finished_at=time.time()), "running")
    [again] = topics.retained_states()                  # what the service publishes again at a connect
    [cleared] = topics.job_deleted("job-1")
    repeats = Repeats(kept=2)
    seen = [repeats.repeated(m.topic, m.payload) for m in (running, event, completed, event, running, again,
                                                            cleared, cleared)]
    # repeats: the event delivered again, the last state published again, a clearing twice; the running state
    # is no longer known (older than the last `kept` messages, and not its topic's last one)
    assert seen == [False, False, False, True, False, True, False, True]
    other = EventTopics(PREFIX, retain_finished_s=None)   # the service restarted: its seq starts again
    [restarted] = other.job_changed(record("job-1", "running"), "queued")
    assert json.loads(restarted.payload)["seq"] == json.loads(running.payload)["seq"]
    assert repeats.repeated(restarted.topic, restarted.payload) is False
    assert repeats.repeated("x", b"not json") is False and repeats.repeated("x", b"not json") is False


def test_a_diverged_jobs_nan_loss_is_published_as_null_as_the_http_event_stream_sends_it():
    """The HTTP API's event stream sends a NaN loss as null (tests/servers/test_http_non_finite.py, read by
    node's JSON.parse): MQTT payloads, read by any subscriber's parser, are the same strict JSON. Before, the
    publisher wrote Python's bare NaN/Infinity tokens (refused by JSON.parse, jq, most parsers), and
    `aspen watch --events --json` printed them on."""
    from orchestrator.watch import event_json

    def strict(text: str | bytes):
        def refuse(token: str):
            raise ValueError(f"not strict JSON: {token}")
        return json.loads(text, parse_constant=refuse)

    topics = EventTopics(PREFIX, retain_finished_s=None)
    [progress] = topics.trainer_polled([TrainerEvent(kind="progress", job_id="j", step=4, time=1.0, data={
        "loss": float("nan"), "grad_norm": float("inf"), "tokens": 64, "tokens_per_s": 50.0, "total_steps": 9})])
    data = strict(progress.payload)
    assert (data["loss"], data["step"]) == (None, 4)
    [state] = topics.job_changed(dataclasses.replace(record("j", "running"), loss=float("nan")), "queued")
    assert strict(state.payload)["loss"] is None
    old = b'{"loss": NaN, "grad_norm": -Infinity, "step": 4}'   # a publisher before this change
    assert strict(event_json("lab/v1/jobs/j/progress", old, False))["payload"] == {"loss": None, "grad_norm": None,
                                                                                   "step": 4}
