"""The Tinker API on `aspen http` over a running service (a real local Ray), driven by the real `tinker` SDK: a
user's model is a job of method interactive, owned by that user, running on the trainer; its loop trains exactly
what aspen's engine trains on the same calls; its optimizer steps are the job's progress, its tokens the user's
account; two users' loops share passes (the trainer's step log shows both jobs in one); another user's model is
404; a session's end completes the job with its final adapter, which `aspen export` exports; a cancelled model
fails its user's next call with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.checkpoint.peft_io import adapter_state_dict
from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import load_base_model
from actors.service.accounts.users import UserBook
from actors.service.scheduler.interactive_jobs import model_folder
from actors.service.trainer.interactive_calls import adapter_name
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.bridge import ProcessLink
from tests.helpers.http_server import running_server
from tests.helpers.service import service_config, wait_for
from tests.helpers.tinker_sdk import datums

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]

ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
WINDOW_S = 0.3   # wide, so that two users' calls sent together meet in one pass


@pytest.fixture(scope="module")
def served(ray_session, tiny_model_dirs, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    base = str(tiny_model_dirs["llama"])
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    alice, _ = book.add("alice")
    bob, _ = book.add("bob")
    name = f"aspen-tinker-{uuid.uuid4().hex[:6]}"
    client = Client.local(service_config(state, tiny_model_dirs["llama"], interactive_window_s=WINDOW_S,
                                         interactive_checkpoint_every=2), name=name)
    client.wait_ready(timeout=300)
    # as `aspen http` serves: the Ray connection in a child process (orchestrator/http/bridge.py)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    app = create_app(link, root, users=book, tinker_dir=lambda: state / "tinker")
    try:
        with running_server(app) as url:
            yield {"url": url, "client": client, "state": state, "base": base, "alice": alice, "bob": bob,
                   "app": app, "root": root, "book": book}
    finally:
        link.close()
        client.shutdown()


def batch(seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    generator = np.random.default_rng(seed)
    rows = []
    for _ in range(2):
        length = int(generator.integers(5, 20))
        rows.append((generator.integers(0, 500, length).tolist(), generator.integers(0, 500, length).tolist(),
                     (generator.random(length) > 0.2).astype(np.float32).tolist()))
    return rows


def engine_reference(base_dir: str, seeds: list[int]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same calls on aspen's engine in this process (one thread, as the service's trainer runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = load_base_model(base_dir, dtype="float32", device="cpu")
        model = InteractiveModel(base, adapter_name("reference"), 4, train_unembed=True)   # the SDK's default
        losses = []
        for seed in seeds:
            rows = tuple(CallDatum(tuple(tokens), {"target_tokens": torch.tensor(targets),
                                                   "weights": torch.tensor(weights)})
                         for tokens, targets, weights in batch(seed))
            (output,) = run_calls(base, [ModelCall(model.name, rows)], backward=True)
            losses.append(output.loss_sum)
            model.optim_step(AdamStep(**ADAM))
        return adapter_state_dict(model.adapter), losses
    finally:
        torch.set_num_threads(threads)


def loop(url: str, key: str, base: str, seeds: list[int], *, together: threading.Barrier | None = None,
         before_close=None) -> dict:
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    training = client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    losses = []
    for seed in seeds:
        if together is not None:
            together.wait(timeout=120)
        losses.append(training.forward_backward(datums(batch(seed)), "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result()
    if before_close is not None:
        before_close(training)
    client.close("success").result()
    return {"model_id": training.model_id, "losses": losses}


def job_of(client: Client, model_id: str):
    (record,) = [r for r in client.jobs() if r.name.endswith(model_id.replace(":", "-"))]
    return record


def test_a_users_loop_is_their_job_trains_as_the_engine_and_exports_its_final_adapter(served, tmp_path):
    client, seeds = served["client"], [1, 2, 3]
    seen: dict = {}

    def while_open(training):
        record = job_of(client, training.model_id)
        seen["record"] = record
        seen["submission"] = client.submission(record.id)
        seen["losses"] = wait_for(lambda: len(client.losses(record.id)) == len(seeds) and client.losses(record.id),
                                  what="the model's optimizer steps in the job table")
        for key, status in ((served["bob"], 404), (served["alice"], 200)):   # another user's model is not found
            answer = httpx.post(f"{served['url']}/api/v1/get_info", headers={"X-API-Key": f"tml-{key}"},
                                json={"model_id": training.model_id, "type": "get_info"})
            assert answer.status_code == status, answer.text

    result = loop(served["url"], served["alice"], served["base"], seeds, before_close=while_open)
    expected, expected_losses = engine_reference(served["base"], seeds)
    assert result["losses"] == expected_losses
    record = seen["record"]
    assert record.state == "running" and record.user == "alice" and record.trainer == "trainer-0"
    assert seen["submission"].job.method == "interactive" and seen["submission"].job.lora.r == 4
    assert [row["step"] for row in seen["losses"]] == [1, 2, 3]
    assert [row["loss"] for row in seen["losses"]] == pytest.approx(expected_losses, rel=1e-6)
    done = wait_for(lambda: (r := client.status(record.id)).finished and r, what="the session's end to end the job")
    assert done.state == "completed", done
    exported = client.export(record.id, tmp_path / "exported")
    weights = load_file(Path(exported) / "adapter_model.safetensors")
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    accounts = {row["user"]: row for row in client.accounts()}
    assert accounts["alice"]["tokens"] == sum(len(tokens) for seed in seeds for tokens, _, _ in batch(seed))


def test_two_users_loops_share_passes_on_the_trainer(served):
    together = threading.Barrier(2)
    results: dict[str, dict] = {}

    def run(user: str, seeds: list[int]) -> None:
        results[user] = loop(served["url"], served[user], served["base"], seeds, together=together)

    threads = [threading.Thread(target=run, args=("alice", [4, 5])), threading.Thread(target=run, args=("bob", [6, 7]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert set(results) == {"alice", "bob"}, "a loop failed (its thread's traceback is above)"
    jobs = {user: job_of(served["client"], results[user]["model_id"]).id for user in results}
    rows = [json.loads(line) for line in (served["state"] / "trainers" / "trainer-0.jsonl").read_text().splitlines()]
    shared = [row for row in rows if row.get("kind") == "interactive" and set(row["jobs"]) == set(jobs.values())]
    assert shared, "no pass held both users' models"
    assert all(row["job_tokens"][jobs["alice"]] > 0 and row["job_tokens"][jobs["bob"]] > 0 for row in shared)


def test_a_cancelled_model_fails_its_users_next_call_saying_so(served):
    client = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['bob']}")
    training = client.create_lora_training_client(base_model=served["base"], rank=2).result()
    training.forward_backward(datums(batch(8)), "cross_entropy").result()
    record = job_of(served["client"], training.model_id)
    assert served["client"].cancel(record.id).state == "cancelled"
    with pytest.raises(Exception, match="closed|no model"):
        training.forward_backward(datums(batch(9)), "cross_entropy").result()
    assert served["client"].status(record.id).state == "cancelled"


def test_refused_calls_on_the_service_hold_up_none_of_the_models_later_calls(served):
    """On the service too (the trainer runs a model's calls in the SDK's order): a save refused at once and a sample
    past the base's context fail alone, and the loop after them trains as the engine does."""
    client = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    training = client.create_lora_training_client(base_model=served["base"], rank=4, seed=0).result()
    training.save_state("kept").result(timeout=120)
    with pytest.raises(tinker.UnprocessableEntityError, match="exists"):
        training.save_state("kept").result(timeout=120)
    (model,) = client.get_server_capabilities().supported_models
    sampler = client.create_sampling_client(base_model=served["base"])
    with pytest.raises(tinker.RequestFailedError, match="past the base's context"):
        sampler.sample(types.ModelInput.from_ints([5] * (model.max_context_length - 1)), 1,
                       types.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)
    losses = []
    for seed in (1, 2):
        losses.append(training.forward_backward(datums(batch(seed)), "cross_entropy").result(timeout=120)
                      .metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result(timeout=120)
    assert losses == engine_reference(served["base"], [1, 2])[1]
    client.close("success").result()


def test_a_trainer_killed_mid_call_loses_nothing_its_models_resume_from_their_checkpoints(served):
    """The trainer dies while a call of the user's loop waits: the model is placed on its successor from its last
    checkpoint (every 2 optimizer steps here), the calls after it are sent again, and the loop goes on as if
    nothing happened: the same losses and the same final adapter as the engine's uninterrupted run. A sampling
    session opened before the loss, on sampler weights saved before it, goes on: its frozen copy died with the
    trainer, and it samples the saved files read back onto the successor (the same greedy tokens as before)."""
    import ray

    from actors.service.scheduler.config import NAMESPACE

    client, seeds = served["client"], [11, 12, 13, 14, 15]
    service = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    training = service.create_lora_training_client(base_model=served["base"], rank=4, seed=0).result()
    losses = []
    for index, seed in enumerate(seeds):
        if index == 1:   # before the checkpoint (after step 2): this save is not sent again, its copy not made again
            saved = training.save_weights_for_sampler("before-the-loss").result()
            sampler = service.create_sampling_client(model_path=saved.path)
            before = sampler.sample(types.ModelInput.from_ints([5, 17, 3]), 1,
                                    types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])).result()
        pending = training.forward_backward(datums(batch(seed)), "cross_entropy")
        if index == 3:   # after a checkpoint (step 2) and a step past it: fb 3 and optim 3 must be sent again
            trainer = client.trainers()[0]
            ray.kill(ray.get_actor(trainer["actor_name"], namespace=NAMESPACE), no_restart=True)
        losses.append(pending.result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result()
    record = job_of(client, training.model_id)
    states = [state for _, state, _ in client.transitions(record.id)]
    assert states[-3:] == ["running", "queued", "running"], states
    assert client.trainers()[0]["restarts"] == 1
    after = sampler.sample(types.ModelInput.from_ints([5, 17, 3]), 1,
                           types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])).result()
    assert after.sequences[0].tokens == before.sequences[0].tokens
    service.close("success").result()
    expected, expected_losses = engine_reference(served["base"], seeds)
    assert losses == expected_losses
    # the trainer's reports of the last steps and of the checkpoint after step 4 may reach the table after the
    # front completed the job: booked all the same
    done = wait_for(lambda: ((r := client.status(record.id)).finished and r.checkpoint_step == 4
                             and r.step == len(seeds) and r), timeout=30,
                    what="the job to complete with its 5 steps and its checkpoint after step 4",
                    state=lambda: client.status(record.id))
    assert done.state == "completed", done
    weights = load_file(Path(done.adapter_dir) / "adapter_model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


KILLED_LOOP = """
import sys, time
import numpy as np
import tinker
from tinker import types

url, key, base = sys.argv[1:4]
training = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}").create_lora_training_client(base_model=base, rank=2)
training = training.result()
print(training.model_id, flush=True)
datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 40))),
                    loss_fn_inputs={"target_tokens": np.arange(2, 41, dtype=np.int64),
                                    "weights": np.ones(39, dtype=np.float32)})
training.forward_backward([datum] * 8, "cross_entropy")
print("sent", flush=True)
time.sleep(120)
"""


def test_a_client_killed_mid_call_ends_its_model_once_its_session_stops_beating(served, tmp_path):
    """The user's process dies while its call waits: nothing else stops (another user's loop trains), the call
    runs to its end on the trainer, and once the session has not beaten for the timeout the model's job
    completes with its final adapter in its folder."""
    backend = served["app"].state.tinker
    backend.sessions.heartbeat_timeout_s = 2.0
    script = tmp_path / "killed_loop.py"
    script.write_text(KILLED_LOOP)
    process = subprocess.Popen([sys.executable, str(script), served["url"], served["bob"], served["base"]],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        model_id = process.stdout.readline().strip()
        assert process.stdout.readline().strip() == "sent", "the loop did not send its call"
    finally:
        process.kill()
        process.wait(timeout=30)
    try:
        other = loop(served["url"], served["alice"], served["base"], [21, 22])
        assert len(other["losses"]) == 2
        record = job_of(served["client"], model_id)
        done = wait_for(lambda: (r := served["client"].status(record.id)).finished and r, timeout=60,
                        what="the killed client's model to end")
    finally:
        backend.sessions.heartbeat_timeout_s = 180.0
    assert done.state == "completed" and "stopped beating" in done.reason, done
    assert (Path(done.adapter_dir) / "adapter_model.safetensors").is_file()


def test_sampling_on_the_service_is_transformers_greedy_decoding_with_the_saved_adapter(served):
    """A model's saved sampler weights, sampled through the service (greedy), continue the prompt as Hugging Face's
    generate does with PEFT's model of the same files; the job's spec reads back as a jobs file (the console's
    clone) without data. After the model's session closed (its job completed), a new session samples the same
    path (the files read back onto a trainer): the same continuation; another user gets 404 until it is
    published, then the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    training = service.create_lora_training_client(base_model=served["base"], rank=4).result()
    for seed in (31, 32):
        training.forward_backward(datums(batch(seed)), "cross_entropy").result()
        training.optim_step(types.AdamParams(**ADAM)).result()
    saved = training.save_weights_for_sampler("s1").result()
    sampler = service.create_sampling_client(model_path=saved.path)
    prompt = [5, 17, 3, 99, 42]
    greedy = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    record = job_of(served["client"], training.model_id)
    folder = Path(record.output_dir) / "sampler_weights" / "s1"
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served["base"], dtype=torch.float32),
                                          folder).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert greedy.sequences[0].tokens == expected[0, len(prompt):].tolist()
    spec = httpx.get(f"{served['url']}/v1/jobs/{record.id}/spec",
                     headers={"Authorization": f"Bearer {served['alice']}"})
    assert spec.status_code == 200 and "method: interactive" in spec.json()["yaml"]
    service.close("success").result()
    wait_for(lambda: job_of(served["client"], training.model_id).state == "completed", timeout=60)

    again = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    read_back = again.create_sampling_client(model_path=saved.path).sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    assert read_back.sequences[0].tokens == expected[0, len(prompt):].tolist()
    bob = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['bob']}")
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=saved.path).sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)).result()
    again.create_rest_client().publish_checkpoint_from_tinker_path(saved.path).result()
    theirs = bob.create_sampling_client(model_path=saved.path).sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    assert theirs.sequences[0].tokens == expected[0, len(prompt):].tolist()
    again.close("success").result()
    bob.close("success").result()


def test_external_weights_on_the_service_download_as_the_merged_model(served, tmp_path):
    """save_weights_external on the service (the adapter saved on the trainer, merged by the HTTP server) and its
    signed URLs: the downloaded folder gives PEFT's logits of the model's sampler weights (saved at the same point)
    within a merge's float32 rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    training = service.create_lora_training_client(base_model=served["base"], rank=4).result()
    training.forward_backward(datums(batch(41)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    saved = training.save_weights_for_sampler("s").result()
    external = training.save_weights_external("hf").result()
    urls = service.create_rest_client().get_external_weights_urls(external.path).result().urls
    for name, link in urls.items():
        answer = httpx.get(link)
        assert answer.status_code == 200, (name, answer.text)
        (tmp_path / name).write_bytes(answer.content)
    folder = Path(job_of(served["client"], training.model_id).output_dir) / "sampler_weights" / "s"
    service.close("success").result()
    assert folder.name == saved.path.rsplit("/", 1)[-1]
    tokens = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(tokens).logits
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served["base"], dtype=torch.float32),
                                              folder).eval()
        expected = reference(tokens).logits
    # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a few float32 epsilons a layer
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_a_custom_loss_runs_on_the_trainer_as_the_sdk_runs_it_on_the_client(served):
    """`create_custom_loss` on the service: the loss travels to the trainer with its calls and trains, over two
    steps, what the SDK's client-side run of the same handle trains (the same metrics, then the same
    log-probabilities from both adapters, bit for bit)."""
    import dataclasses

    def weighted_margin(logprobs, weights):
        loss = -(logprobs * weights).sum() + 0.1 * torch.relu(-2.0 - logprobs).sum()
        return loss, {"custom/weights:sum": weights.sum()}

    client = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}")
    handle = client.create_custom_loss(weighted_margin, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is not None
    on_client = dataclasses.replace(handle, loss_id=None)
    models = [client.create_lora_training_client(base_model=served["base"], rank=4, seed=5).result()
              for _ in range(2)]
    for seed in (11, 12):
        data = datums(batch(seed))
        results = [training.forward_backward_custom(data, loss).result()
                   for training, loss in zip(models, (handle, on_client), strict=True)]
        assert results[0].metrics["loss:sum"] == results[1].metrics["loss:sum"]
        assert results[0].metrics["custom/weights:sum"] == results[1].metrics["custom/weights:sum"]
        for training in models:
            training.optim_step(types.AdamParams(**ADAM)).result()
    after = [training.forward(datums(batch(13)), "cross_entropy").result() for training in models]
    assert [o["logprobs"].tolist() for o in after[0].loss_fn_outputs] == \
        [o["logprobs"].tolist() for o in after[1].loss_fn_outputs]
    client.close("success").result()


def test_calls_to_a_trainer_busy_in_a_long_sampling_wait_for_it_and_lose_nothing(served, monkeypatch):
    """A sampling of thousands of tokens holds the trainer (its actor answers one call at a time) far longer than
    the service waits for an answer (shortened here from 10 s to 0.3 s, so that a short test is as long, in those
    waits, as minutes of sampling on a real base): the user's loop sent meanwhile is not refused, not failed and
    not run twice, and the outcomes the trainer returns once free reach their calls (a take left unanswered was
    abandoned, and the outcomes it took were lost: the calls waited for ever). The trainer decodes the sampling in
    slices, so the loops' calls (a model created meanwhile too) run between them and end long before it does.
    Through the real SDK, an HTTP server whose Ray client is in its own process (`ServiceLink(client=...)`, where
    the waits can be shortened)."""
    import time as clock

    from orchestrator.service_calls import ServiceLink
    from orchestrator.tinker import tinker_service

    monkeypatch.setattr(tinker_service, "QUEUE_WAIT_S", 0.3)
    monkeypatch.setattr(tinker_service, "CALL_TIMEOUT_S", 2.0)   # a model's creation waited this long, then failed
    app = create_app(ServiceLink(client=served["client"]), served["root"], users=served["book"],
                     tinker_dir=lambda: served["state"] / "tinker")
    seeds = [41, 42]
    with running_server(app) as url:
        service = tinker.ServiceClient(base_url=url, api_key=f"tml-{served['alice']}")
        training = service.create_lora_training_client(base_model=served["base"], rank=4, seed=0).result()
        sampler = service.create_sampling_client(base_model=served["base"])
        started = clock.monotonic()
        # as many tokens as 16 samples of 4096 would be, within the tiny base's context of 512 (longer is refused): two
        # requests of 64 (the most one may ask); one made the pass only ~2x the loops' time on a busy CI machine
        long_samples = [sampler.sample(types.ModelInput.from_ints([5, 17, 3]), 64,
                                       types.SamplingParams(max_tokens=509, temperature=1.0, seed=seed, stop=[]))
                        for seed in (7, 8)]
        clock.sleep(0.5)   # the sampling pass has begun: what follows waits for the trainer
        losses = []
        for seed in seeds:
            losses.append(training.forward_backward(datums(batch(seed)), "cross_entropy"))
            training.optim_step(types.AdamParams(**ADAM))
        # a model created meanwhile: created there once the pass ends, its calls after it (it failed at the call
        # timeout, its job ended failed while its creation still ran on the trainer)
        second = service.create_lora_training_client(base_model=served["base"], rank=4, seed=0).result()
        created_s = clock.monotonic() - started
        second_losses = []
        for seed in seeds:
            second_losses.append(second.forward_backward(datums(batch(seed)), "cross_entropy"))
            second.optim_step(types.AdamParams(**ADAM))
        # the trainer decodes the sampling in slices (interactive_sample_slice_s), the loops' calls between them:
        # they end long before it does (they waited for its end)
        losses = [pending.result(timeout=240).metrics["loss:sum"] for pending in losses]
        second_losses = [pending.result(timeout=240).metrics["loss:sum"] for pending in second_losses]
        trained_s = clock.monotonic() - started
        sampled = [pending.result(timeout=240) for pending in long_samples]   # bounded: lost outcomes waited for ever
        busy_s = clock.monotonic() - started
        second_job = job_of(served["client"], second.model_id)
        service.close("success").result()
    assert busy_s > 10 * tinker_service.QUEUE_WAIT_S, busy_s   # the trainer was busy for many of the service's waits
    assert busy_s - created_s > 2 * tinker_service.CALL_TIMEOUT_S, (created_s, busy_s)   # created early in the pass
    assert busy_s > 2 * trained_s, (trained_s, busy_s)
    assert second_job.state == "running", (second_job.state, second_job.reason)
    assert all(len(s.sequences) == 64 and max(len(q.tokens) for q in s.sequences) > 100 for s in sampled)
    _, expected_losses = engine_reference(served["base"], seeds)
    assert losses == expected_losses   # each call ran once, in order
    assert second_losses == expected_losses


COPY_PROMPT = [5, 17, 3, 99, 42]


def greedy_tokens(client, path: str) -> list[int]:
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    sampled = client.create_sampling_client(model_path=path).sample(types.ModelInput.from_ints(COPY_PROMPT), 1,
                                                                    params).result()
    return sampled.sequences[0].tokens


def test_a_copy_on_the_service_links_its_files_and_outlives_its_source(served):
    """The copy of a model's saved sampler weights over the service is hard-linked into the service's Tinker
    folder (`du` counts its weights once; before, its bytes twice) and samples, after its source is saved again and
    then deleted, the source's greedy tokens when copied."""
    alice = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}", project_id="p")
    training = alice.create_lora_training_client(base_model=served["base"], rank=4).result()
    training.forward_backward(datums(batch(41)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    path = training.save_weights_for_sampler("w").result().path
    expected = greedy_tokens(alice, path)
    copied = alice.copy_weights(path).result()

    run = copied.removeprefix("tinker://").split("/")[0]
    folders = [model_folder(Path(served["state"]) / "tinker", run_id) / "sampler_weights" / "w"
               for run_id in (training.model_id, run)]
    out = subprocess.run(["du", "-sb", "--", *map(str, folders)], check=True, capture_output=True, text=True).stdout
    source_size, copy_extra = (int(line.split()[0]) for line in out.splitlines())
    weights = (folders[0] / "adapter_model.safetensors").stat().st_size
    assert copy_extra < source_size - weights + 4096, (source_size, copy_extra, weights)

    for seed in (42, 43):
        training.forward_backward(datums(batch(seed)), "cross_entropy").result()
        training.optim_step(types.AdamParams(**ADAM)).result()
    assert training.save_weights_for_sampler("w").result().path == path   # saved again under its name
    alice.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert greedy_tokens(alice, copied) == expected
    alice.close("success").result()
