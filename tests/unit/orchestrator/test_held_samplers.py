"""The front's saved samplers read back onto trainers (orchestrator/tinker/held_samplers.py), against a trainer whose
reads the test holds back: sessions asking for one path at once share one read; a slow read of one path keeps no
session of another waiting; a failed read fails every session that waited for it, saying why, and the next asks
again; the last session's end takes the copy off; a copy whose trainer died is read again."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
from fastapi import HTTPException

pytest.importorskip("tinker")

from orchestrator.tinker.held_samplers import HeldSamplers


class Trainers:
    """Trainers whose reads end when the test says (`finish`)."""

    def __init__(self):
        self.reads: list[tuple[str, str, Future]] = []
        self.removed: list[tuple[str, str | None]] = []
        self.asked = threading.Condition()

    def hold_sampler(self, name: str, folder: str, base_model: str) -> tuple[str, Future]:
        done: Future = Future()
        with self.asked:
            self.reads.append((name, folder, done))
            self.asked.notify_all()
        return f"trainer-{len(self.reads)}", done

    def remove_adapter(self, name: str, model_id: str | None = None, trainer: str | None = None) -> None:
        self.removed.append((name, trainer))

    def wait_for_reads(self, count: int) -> None:
        with self.asked:
            assert self.asked.wait_for(lambda: len(self.reads) >= count, timeout=10)


def in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as error:  # noqa: BLE001 - the test reads it
            out.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def held_after_read(trainers: Trainers, held: HeldSamplers, path: str, session: str, reads: int):
    """`held.hold(path)` for `session`, its read (the trainers' `reads`-th) answered: what it returned."""
    thread, out = in_thread(lambda: held.hold(path, "/a", "base", session))
    trainers.wait_for_reads(reads)
    trainers.reads[reads - 1][2].set_result("a")
    thread.join(timeout=10)
    return out[0]


def test_one_read_per_path_and_a_slow_one_keeps_nobody_else_waiting():
    trainers = Trainers()
    held = HeldSamplers(trainers)
    first, first_out = in_thread(lambda: held.hold("tinker://a/sampler_weights/s", "/a", "base", "s1:sample:0"))
    trainers.wait_for_reads(1)
    second, second_out = in_thread(lambda: held.hold("tinker://a/sampler_weights/s", "/a", "base", "s2:sample:0"))
    other, other_out = in_thread(lambda: held.hold("tinker://b/sampler_weights/s", "/b", "base", "s3:sample:0"))
    trainers.wait_for_reads(2)     # b's read went ahead while a's waits
    trainers.reads[1][2].set_result("b")
    other.join(timeout=10)
    assert other_out and other_out[0].trainer == "trainer-2" and first.is_alive() and second.is_alive()
    trainers.reads[0][2].set_result("a")
    first.join(timeout=10)
    second.join(timeout=10)
    assert first_out[0] is second_out[0] and len(trainers.reads) == 2   # one read of a, for both sessions
    assert first_out[0].sessions == {"s1:sample:0", "s2:sample:0"}

    held.release_session("s1")
    assert trainers.removed == []  # s2 still samples it
    held.release_session("s2")
    assert trainers.removed == [(first_out[0].adapter, "trainer-1")]


def test_a_failed_read_fails_each_waiting_session_and_the_next_asks_again():
    trainers = Trainers()
    held = HeldSamplers(trainers)
    path = "tinker://a/sampler_weights/s"
    first, first_out = in_thread(lambda: held.hold(path, "/a", "base", "s1:sample:0"))
    trainers.wait_for_reads(1)
    second, second_out = in_thread(lambda: held.hold(path, "/a", "base", "s2:sample:0"))
    trainers.reads[0][2].set_exception(ValueError("/a/adapter_model.safetensors is not a safetensors file"))
    first.join(timeout=10)
    second.join(timeout=10)
    for out in (first_out, second_out):
        assert isinstance(out[0], HTTPException) and out[0].status_code == 422
        assert "adapter_model.safetensors is not a safetensors file" in out[0].detail
    assert held_after_read(trainers, held, path, "s3:sample:0", 2).trainer == "trainer-2"


def test_a_copy_whose_trainer_died_is_read_again_for_the_same_sessions():
    trainers = Trainers()
    held = HeldSamplers(trainers)
    path = "tinker://a/sampler_weights/s"
    held_after_read(trainers, held, path, "s1:sample:0", 1)
    held.lost("trainer-1")
    again = held_after_read(trainers, held, path, "s2:sample:0", 2)
    assert again.trainer == "trainer-2" and again.sessions == {"s1:sample:0", "s2:sample:0"}
    held.release_session("s1")
    held.release_session("s2")
    assert trainers.removed == [(again.adapter, "trainer-2")]   # the dead trainer is not asked
