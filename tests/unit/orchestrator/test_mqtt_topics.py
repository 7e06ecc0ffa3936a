"""What the service publishes on MQTT, checked without a broker against the contract that subscribers read
(orchestrator/mqtt/topics.py's docstring, docs/monitoring.md): each job's state retained at QoS 1 on
`jobs/<job>/state`, progress at QoS 0, notable events at QoS 1 on `jobs/<job>/events`, a retained state
cleared as MQTT clears one (a zero-length retained message) when the job is deleted and once a finished
job's retention ran out, each once; and the outbox between the scheduler and the connection: bounded, never
blocking, dropping with a rate-limited warning while the broker is away, remembering dropped clearings.
tests/servers/test_mqtt_events.py checks the same against real brokers."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest

from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent
from orchestrator.mqtt.connection import Outbox
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
    assert (progress.topic, progress.qos, progress.retain) == ("lab/v1/jobs/a_b/progress", 0, False)
    assert payload(progress) == {"job": "a/b", "step": 4, "loss": 2.0, "tokens_per_s": 50.0, "tokens": 64,
                                 "total_steps": 9, "lr": 1e-3, "time": 12.5}
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


def test_the_outbox_is_bounded_drops_while_down_and_warns_rarely(caplog):
    outbox = Outbox(3, "mqtt://broker:1883")
    message = Message("t", b"x", 0, False)
    with caplog.at_level(logging.WARNING):
        assert [outbox.put(message) for _ in range(5)] == [True, True, True, False, False]
        assert len(outbox) == 3
        assert outbox.take() is message and len(outbox) == 2
        outbox.down = True
        assert outbox.put(message) is False
        assert outbox.drop_all() == 2 and outbox.take() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the queue is full" in warnings[0] and "mqtt://broker:1883" in warnings[0]
    outbox.closed = True
    assert outbox.put(message) is False and len(outbox) == 0


def test_the_outbox_remembers_clearings_until_they_are_published():
    topics = EventTopics(PREFIX, retain_finished_s=None)
    outbox = Outbox(10, "the embedded broker")
    outbox.down = True                                   # the broker is away: the clearing is dropped
    [clearing] = topics.job_deleted("gone")
    assert outbox.put(clearing) is False
    assert outbox.pending_clears() == ["gone"]           # sent again at the next connect
    outbox.down = False
    [queued] = topics.job_deleted("queued-clear")
    assert outbox.put(queued)
    assert outbox.pending_clears() == ["gone"]           # a queued one goes out in turn
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
