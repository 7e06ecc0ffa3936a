"""Tinker training clients created through the real `tinker` SDK on `aspen http` over a running service (a real
local Ray) whose one trainer takes one job at once (`max_jobs: 1`) and is running alice's batch job. A model is a
running job: it was once opened there beside the batch job on memory alone, two jobs on a trainer the operator
limited to one. Now:

- carol, whose quota is `running=0` (nothing of hers may ever run), is refused at once: the SDK raises
  `UnprocessableEntityError` (422, not retried), its message naming the quota and the command that raises it;
- alice, at her `running=1` with the batch job, is over quota: 429 with Retry-After, which the SDK retries, then
  raises `RateLimitError` naming max_running; bob finds the trainer's one slot taken: 503 with Retry-After, retried,
  then `InternalServerError` naming max_jobs (each seen once with the SDK's retries turned off);
- with the SDK's own retries, bob's and alice's creates wait: the batch job cancelled, one of them opens on the
  trainer, the other waits on until that model's session ends, then opens.

The references: the service's own job table (through the Ray client), polled throughout: the trainer never runs two
jobs, and each model's job runs only once the job before it ended (its transitions)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from actors.service.accounts.users import UserBook
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.api_client import HttpClient
from orchestrator.http.bridge import ProcessLink
from tests.helpers import tinker_sizes as sized
from tests.helpers.http_server import running_server
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, wait_for, write_task_data

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]

RETRY_AFTER_S = 30   # what aspen answers a create that has no room now with (the SDK waits that long)


class Watch:
    """The service's running jobs on trainer-0, polled through the Ray client (the most seen at once)."""

    def __init__(self, client: Client):
        self.client = client
        self.most: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.wait(0.2):
            running = [r.name for r in self.client.jobs() if r.state == "running" and r.trainer == "trainer-0"]
            if len(running) > len(self.most):
                self.most = running

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def sdk(url: str, token: str):
    return tinker.ServiceClient(base_url=url, api_key=f"tml-{token}")


def answer_without_retries(url: str, token: str, base: str, who: str) -> Exception:
    """What the SDK raises for a create once its retries are spent, seen at once: its clients made with none."""
    # the SDK's HTTP client, whose `max_retries` defaults to 10
    from tinker._client import AsyncTinker

    defaults = AsyncTinker.__init__.__kwdefaults__
    kept = defaults["max_retries"]
    defaults["max_retries"] = 0
    client = sdk(url, token)
    try:
        client.create_lora_training_client(base_model=base, rank=4).result(timeout=120)
    except Exception as error:  # noqa: BLE001 - the test says which it must be
        return error
    finally:
        client.close("success").result(timeout=60)   # while the server answers (closes_tinker_clients says why)
        defaults["max_retries"] = kept
    raise AssertionError(f"{who}'s model was created past a limit (the trainer's max_jobs, their quota)")


def create_in_thread(client, base: str, results: dict, key: str) -> threading.Thread:
    def run() -> None:
        try:
            results[key] = client.create_lora_training_client(base_model=base, rank=4).result(timeout=600)
        except Exception as error:  # noqa: BLE001 - said by the test
            results[key] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def model_job(client: Client, model_id: str):
    (record,) = [r for r in client.jobs() if r.name.endswith(model_id.replace(":", "-"))]
    return record


def at(client: Client, job_id: str, states: tuple[str, ...]) -> float:
    """When the job first entered one of `states` (its transitions)."""
    return min(when for when, state, _ in client.transitions(job_id) if state in states)


@pytest.mark.long   # a service of its own, a batch job, and two SDK creates that wait out Retry-After (~2-4 min)
def test_a_model_is_a_job_against_the_trainers_max_jobs_and_its_users_quota(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    state, data = tmp_path / "state", write_task_data(tmp_path / "data", "long")
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    alice, _ = book.add("alice", data_roots=[str(data.parent)], quotas={"running": 1})
    bob, _ = book.add("bob")
    carol, _ = book.add("carol", quotas={"running": 0})
    name = f"aspen-slots-{uuid.uuid4().hex[:6]}"
    client = Client.local(service_config(state, tiny_model_dirs["llama"], max_jobs=1, listeners=NO_LISTENERS),
                          name=name)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    results: dict = {}
    try:
        client.wait_ready(timeout=300)
        app = create_app(link, root, users=book, tinker_dir=lambda: state / "tinker")
        with running_server(app) as url, Watch(client) as watch:
            batch = HttpClient(url, alice).submit(job_dict("long", data, 100_000), base_model=base)
            wait_for(lambda: batch.id in next(t for t in client.trainers() if t["id"] == "trainer-0").get("jobs", ()),
                     what="the batch job running on trainer-0", timeout=300)

            started, carols = time.monotonic(), sdk(url, carol)
            with pytest.raises(tinker.UnprocessableEntityError) as never:
                carols.create_lora_training_client(base_model=base, rank=4).result(timeout=120)
            assert time.monotonic() - started < 20, "a quota of 0 was retried"
            carols.close("success").result(timeout=60)
            assert "carol's max_running quota is 0" in str(never.value), str(never.value)
            assert "aspen user set carol --quota running=N" in str(never.value), str(never.value)

            over = answer_without_retries(url, alice, base, "alice")
            assert isinstance(over, tinker.RateLimitError), repr(over)
            assert "user alice runs 1 jobs (long), their max_running quota (1" in str(over), str(over)
            full = answer_without_retries(url, bob, base, "bob")
            assert isinstance(full, tinker.InternalServerError), repr(full)
            assert "trainer-0 runs 1 jobs, its max_jobs (1)" in str(full), str(full)
            assert "raises the trainer's max_jobs" in str(full), str(full)

            bobs, alices = sdk(url, bob), sdk(url, alice)
            threads = [create_in_thread(bobs, base, results, "bob"), create_in_thread(alices, base, results, "alice")]
            time.sleep(RETRY_AFTER_S + 5)   # each has been answered, and has retried at least once
            assert results == {}, results
            assert [r.name for r in client.jobs() if r.state == "running"] == ["long"]
            assert client.cancel(batch.id).state in ("cancelled", "running")
            first = wait_for(lambda: next(iter(results), None), what="a create once the batch job ended",
                             timeout=3 * RETRY_AFTER_S)
            assert not isinstance(results[first], Exception), results[first]
            assert len(results) == 1, results   # the other waits: the model holds the slot
            earlier = model_job(client, results[first].model_id)
            (bobs if first == "bob" else alices).close("success").result(timeout=120)
            second = "alice" if first == "bob" else "bob"
            for thread in threads:
                thread.join(timeout=3 * RETRY_AFTER_S)
            assert not isinstance(results.get(second), Exception) and second in results, results
            later = model_job(client, results[second].model_id)
            (alices if first == "bob" else bobs).close("success").result(timeout=120)
            wait_for(lambda: all(model_job(client, results[k].model_id).state == "completed" for k in results),
                     what="both sessions' models completed", timeout=120)
        most = watch.most
        ended = {"long": at(client, batch.id, ("cancelled",)),
                 "earlier": at(client, earlier.id, ("completed", "failed", "cancelled"))}
        opened = {"earlier": at(client, earlier.id, ("running",)), "later": at(client, later.id, ("running",))}
    finally:
        link.close()
        client.shutdown()
    assert len(most) == 1, f"the trainer ran {most} at once (max_jobs 1)"
    assert earlier.user == first and later.user == second and earlier.trainer == later.trainer == "trainer-0"
    assert ended["long"] <= opened["earlier"] and ended["earlier"] <= opened["later"], (ended, opened)


@pytest.mark.long   # two services whose trainer loads (the first measures its fixed memory), no training (1-3 min)
def test_a_model_that_never_fits_a_trainer_is_refused_at_once_saying_its_size_and_what_to_change(
        ray_session, tiny_model_dirs, tmp_path):
    """A model whose adapter and AdamW state exceed the trainer's budget beside its base even alone was answered
    503 and retried by the SDK for ~5 minutes; it is refused at once (422: `UnprocessableEntityError`), as a batch
    job that never fits is. The references: the trainer's fixed memory as a first service of the same kind reports
    it and the model's adapter memory counted from the base's layer shapes (tests/helpers/tinker_sizes.py)."""
    base = str(tiny_model_dirs["llama"])
    _, model_bytes = sized.lora_bytes(base)   # a rank-256 model's (MAX_RANK), the SDK's default parts
    first = Client.local(service_config(tmp_path / "first", tiny_model_dirs["llama"]))
    try:
        fixed = sized.fixed_bytes(first)
    finally:
        first.shutdown()
    state = tmp_path / "state"
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    bob, _ = book.add("bob")
    name = f"aspen-never-{uuid.uuid4().hex[:6]}"
    # half the rank-256 model's memory beside the trainer's fixed memory: a rank-4 model (1/64 of it) fits
    client = Client.local(service_config(state, tiny_model_dirs["llama"], memory_budget_bytes=fixed + model_bytes // 2,
                                         listeners=NO_LISTENERS), name=name)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    try:
        now = sized.fixed_bytes(client)
        assert now + model_bytes // 64 <= fixed + model_bytes // 2 < now + model_bytes, (fixed, now, model_bytes)
        app = create_app(link, root, users=book, tinker_dir=lambda: state / "tinker")
        with running_server(app) as url:
            bobs, started = sdk(url, bob), time.monotonic()
            with pytest.raises(tinker.UnprocessableEntityError) as never:
                bobs.create_lora_training_client(base_model=base, rank=sized.MODEL_RANK).result(timeout=120)
            assert time.monotonic() - started < 20, "a model that can never fit was retried"
            said = str(never.value)
            assert "cannot run on any trainer: its adapter (rank=256) needs " in said, said
            assert "trainer-0's memory budget" in said and "create it with a lower rank" in said, said
            with pytest.raises(tinker.NotFoundError, match="is not served here"):   # a base no trainer holds
                bobs.create_lora_training_client(base_model="no-such-base", rank=4).result(timeout=120)
            assert time.monotonic() - started < 40, "a base no trainer holds was retried"
            training = bobs.create_lora_training_client(base_model=base, rank=4).result(timeout=120)
            assert model_job(client, training.model_id).state == "running"   # a smaller one fits
            bobs.close("success").result(timeout=120)
        assert [r.state for r in client.jobs()] == ["completed"]   # the refused one was never entered
    finally:
        link.close()
        client.shutdown()
