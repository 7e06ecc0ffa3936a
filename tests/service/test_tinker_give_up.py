"""A lost trainer's Tinker model that cannot be placed again is given up, and its job ends: through the real
`tinker` SDK on `aspen http` over a running service (a real local Ray) of one trainer. dave trains a model a step
(the service checkpoints it after each optimizer step here) and saves its state; an admin sets his `running` quota
to 0 (no job of his may run) and his trainer is killed during a call. The front's re-placement is refused (his
quota never lets the model run now), so it gives the model up: his call fails with why. Its job once stayed
`queued` in the table for ever (a model nobody can use, shown by `aspen status`); now it ends `failed` with the
reason his call got, naming the checkpoint kept in its folder and his newest saved state. Once his quota lets him
run again, that state loads in a new training client on the trainer's successor. The references: the service's own
job table (`Client.status`), the SDK's failed future, the checkpoint as the trainer wrote it (`read_checkpoint`),
and the SDK's own load: the same loss on the same datum as the model had before its trainer was lost. The loaded
model, given up as the front gives up one placed again whose calls could not be sent there, leaves its trainer at
once (the trainer's own heartbeat answer says so): it once stayed open there, its memory held."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.checkpoint.interactive_state import read_checkpoint
from actors.service.accounts.users import UserBook
from actors.service.scheduler.config import NAMESPACE
from tests.helpers.service import wait_for
from tests.helpers.tinker_sdk import datums
from tests.helpers.tinker_service import ROW, kill_trainer, model_job, tinker_service, trained_model, trainer

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]


@pytest.mark.long   # a service whose trainer is killed (1-2 min)
def test_a_lost_trainers_model_that_cannot_be_placed_again_ends_its_job_failed(ray_session, tiny_model_dirs,
                                                                              tmp_path):
    import ray

    base, state = str(tiny_model_dirs["llama"]), tmp_path / "state"
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    dave, _ = book.add("dave")
    with tinker_service(ray_session, state, [trainer(base, interactive_checkpoint_every=1)], root, book,
                        prefix="aspen-giveup") as (client, url, app):
        service, training = trained_model(tinker, url, dave, base)
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result(timeout=120)   # checkpointed after it
        saved = training.save_state("before-loss").result(timeout=120).path
        before = training.forward_backward(datums([ROW]), "cross_entropy").result(timeout=120).metrics["loss:sum"]
        model = model_job(client, training)
        assert client.status(model.id).state == "running"
        book.update("dave", quotas={"running": 0})
        kill_trainer(client, "trainer-0")
        pending = training.forward_backward(datums([ROW]), "cross_entropy")   # finds the trainer dead
        with pytest.raises(Exception) as failed:
            pending.result(timeout=240)
        said = str(failed.value)
        assert "could not be placed again" in said and "max_running quota is 0" in said, said
        ended = wait_for(lambda: (r := client.status(model.id)).finished and r, timeout=60,
                         what="the given-up model's job ended", state=lambda: client.status(model.id))
        assert ended.state == "failed", ended
        assert "could not be placed again" in ended.reason and "max_running quota is 0" in ended.reason, ended
        assert ended.trainer is None, ended
        kept = re.search(r"its last checkpoint is kept in (\S+?)[;,]", ended.reason)
        assert kept and Path(kept[1]).parent == Path(ended.output_dir), ended.reason
        facts, _, _ = read_checkpoint(Path(kept[1]).parent)
        assert facts["steps"] == 1 and facts["model_id"] == training.model_id, facts
        assert f"its newest saved state, {saved}, loads" in ended.reason, ended.reason
        book.update("dave", quotas={"running": None})   # room again: the saved state loads on the successor
        wait_for(lambda: [t for t in client.trainers() if t["ready"] and t["restarts"]], timeout=120,
                 what="trainer-0's successor ready", state=client.trainers)
        again = service.create_training_client_from_state(saved).result(timeout=240)
        after = again.forward_backward(datums([ROW]), "cross_entropy").result(timeout=240).metrics["loss:sum"]
        assert after == pytest.approx(before, rel=1e-5), (after, before)
        # given up once placed (its calls could not be sent again there): it leaves that trainer at once, where it
        # once stayed open, its memory held, until its heartbeats lapsed; the trainer's own heartbeat answer says
        front, (placed,), job = app.state.tinker.calls, client.trainers(), model_job(client, again)
        front._give_up(again.model_id, front.models[again.model_id], "its calls could not be sent again: (a test's)")
        handle = ray.get_actor(placed["actor_name"], namespace=NAMESPACE)
        wait_for(lambda: ray.get(handle.tinker_beat.remote([again.model_id])) == [again.model_id], timeout=30,
                 what="the given-up model closed on its trainer", state=lambda: client.status(job.id))
        assert client.status(job.id).state == "failed"
        service.close("success").result(timeout=120)   # its session ends: nothing left to finish


@pytest.mark.long   # a service whose trainer is killed (~1 min)
def test_a_lost_trainers_model_without_room_is_given_up_after_the_fronts_setting(ray_session, tiny_model_dirs,
                                                                                tmp_path, monkeypatch):
    """The front tries to place a lost trainer's model again for $ASPEN_TINKER_RECOVER_FOR_S (once a constant 5
    minutes): here 3 s. dave runs two models at `running=1` (set after their creates); their trainer is killed, so at
    most one of them is placed again on its successor, and the other waits for room (his quota, or a ready trainer)
    and is given up at the bound, its job `failed` saying so, well before 5 minutes."""
    import time

    monkeypatch.setenv("ASPEN_TINKER_RECOVER_FOR_S", "3")
    base, state = str(tiny_model_dirs["llama"]), tmp_path / "state"
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    dave, _ = book.add("dave")
    with tinker_service(ray_session, state, [trainer(base)], root, book, prefix="aspen-bound") as (client, url, _):
        service, first = trained_model(tinker, url, dave, base)
        second = service.create_lora_training_client(base_model=base, rank=4, seed=1).result(timeout=120)
        jobs = [model_job(client, training).id for training in (first, second)]
        book.update("dave", quotas={"running": 1})
        kill_trainer(client, "trainer-0")
        lost = time.monotonic()
        pending = [training.forward_backward(datums([ROW]), "cross_entropy") for training in (first, second)]
        ended = wait_for(lambda: [r for job in jobs if (r := client.status(job)).finished], timeout=120,
                         what="a model given up at the bound", state=lambda: [client.status(job) for job in jobs])
        took = time.monotonic() - lost
        assert 3 <= took < 60, took
        for record in ended:
            assert record.state == "failed", record
            assert "could not be placed again within 3s (ASPEN_TINKER_RECOVER_FOR_S)" in record.reason, record
        for call, job in zip(pending, jobs, strict=True):   # a given-up model's call fails with why
            if client.status(job).finished:
                with pytest.raises(Exception, match="could not be placed again within 3s"):
                    call.result(timeout=120)
        service.close("success").result(timeout=120)
