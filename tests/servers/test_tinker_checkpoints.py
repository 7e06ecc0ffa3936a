"""The Tinker API's checkpoints and runs, driven by the real `tinker` SDK and its RestClient: a user's runs and
checkpoints listed, paged and deleted; time to live and metadata kept, expired checkpoints deleted (by a request or by
the front on its own); a published checkpoint loaded by another user; external weights as the merged model through
signed URLs; the tokenizer a client loads."""


from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import InteractiveCalls
from orchestrator.tinker.tinker_routes import TinkerBackend
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import datums, tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import (  # noqa: E402
    ADAM,
    BASE,
    KEYS,
    WINDOW_S,
    batch,
    greedy,
    same_samples,
    saved_weights,
    train_steps,
)


def test_the_rest_client_lists_a_users_runs_and_checkpoints_and_deletes_one(sdk_server):
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    training.forward_backward(datums(batch(1)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    state = training.save_state("ck1").result()
    sampler = training.save_weights_for_sampler("s1").result()
    rest = client.create_rest_client()
    run = rest.get_training_run(training.model_id).result()
    assert run.training_run_id == training.model_id and run.lora_rank == 4 and run.base_model == BASE
    assert run.last_checkpoint.tinker_path == state.path
    assert run.last_sampler_checkpoint.tinker_path == sampler.path
    listed = rest.list_checkpoints(training.model_id).result()
    assert sorted(c.checkpoint_id for c in listed.checkpoints) == ["sampler_weights/s1", "weights/ck1"]
    assert all(c.size_bytes > 0 for c in listed.checkpoints)
    assert rest.get_weights_info_by_tinker_path(state.path).result().lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(sampler.path).result()
    listed = rest.list_checkpoints(training.model_id).result()
    assert [c.checkpoint_id for c in listed.checkpoints] == ["weights/ck1"]
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token").create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run(training.model_id).result()
    assert bob.list_user_checkpoints().result().checkpoints == []
    client.close("success").result()


@pytest.mark.parametrize("parts", [{"train_attn": True, "train_mlp": False, "train_unembed": False},
                                   {"train_attn": False, "train_mlp": True, "train_unembed": True},
                                   {"train_attn": True, "train_mlp": True, "train_unembed": True}])
def test_weights_info_says_which_parts_a_checkpoint_trains(sdk_server, parts):
    """The weights info of a saved state and of sampler weights gives the parts its model was created to train (the
    SDK's LoraConfig), as its adapter's PEFT target modules hold them (train_attn and train_mlp were left out)."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4, **parts).result()
    rest = client.create_rest_client()
    for saved in (training.save_state("parts").result(), training.save_weights_for_sampler("parts").result()):
        info = rest.get_weights_info_by_tinker_path(saved.path).result()
        assert (info.train_attn, info.train_mlp, info.train_unembed, info.lora_rank) == \
            (parts["train_attn"], parts["train_mlp"], parts["train_unembed"], 4), saved.path
    client.close("success").result()


def test_the_sdks_get_tokenizer_loads_the_bases_own(tmp_path, monkeypatch, tiny_model_dirs):
    """The SDK's `get_tokenizer()` loads what get_info names (`tokenizer_id`): for a base read from a folder, that
    folder, so that it works with no hub at hand and tokenizes as the base does; the embedded base names its hub id;
    a base with neither (built in memory, a GGUF file of one's own) names none."""
    from actors.engine.models import load_base_model
    from actors.storage.base_identity import tokenizer_id
    from actors.storage.sources import ALIAS_HUB_IDS, ModelSource, resolve_source

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    with tinker_in_process(base, BASE, tmp_path / "weights", KEYS.get, window_s=WINDOW_S) as (url, _, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        tokenizer = training.get_tokenizer()
        text = "Question: what is 12 + 30?\nAnswer: 42"
        assert tokenizer.encode(text) == base.tokenizer.encode(text)
        client.close("success").result()
    assert tokenizer_id("smollm2-135m", resolve_source("smollm2-135m")) == ALIAS_HUB_IDS["smollm2-135m"]
    assert tokenizer_id("in-memory", ModelSource("in-memory", None, True)) is None
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    assert tokenizer_id(str(own), ModelSource(str(tmp_path), "mine.gguf", True)) is None


def test_a_client_on_the_servers_machine_loads_the_embedded_bases_tokenizer_with_no_hub(tmp_path, monkeypatch):
    """The embedded smollm2-135m (a GGUF file) and the SDK's `get_tokenizer()` on the server's machine, with the hub
    out of reach (HF_HUB_OFFLINE, an empty HF cache): get_info names the folder its tokenizer is read from here (the
    converted GGUF folder), which tokenizes as the trainer's own tokenizer does; a client elsewhere (not a loopback
    address) is told the hub id, which a machine with the hub or its cache loads."""
    from starlette.requests import Request

    from actors.engine.models import load_base_model
    from actors.storage.sources import ALIAS_HUB_IDS
    from orchestrator.tinker.tinker_routes import tokenizer_for

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    base = load_base_model("smollm2-135m", dtype="float32", device="cpu")
    served = tinker_in_process(base, "smollm2-135m", tmp_path / "weights", KEYS.get, window_s=WINDOW_S)
    with served as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model="smollm2-135m", rank=4).result()
        tokenizer = training.get_tokenizer()
        for text in ("Question: what is 12 + 30?\nAnswer: 42", "<|im_start|>user\nHola, ¿qué tal?<|im_end|>\n"):
            assert tokenizer.encode(text, add_special_tokens=False) == base.tokenizer.encode(text,
                                                                                          add_special_tokens=False)
        client.close("success").result()
        facts = backend.facts("smollm2-135m")
    elsewhere = Request({"type": "http", "client": ("10.0.0.7", 51000), "headers": []})
    assert tokenizer_for(facts, elsewhere) == ALIAS_HUB_IDS["smollm2-135m"]
    here = Request({"type": "http", "client": ("127.0.0.1", 51000), "headers": []})
    assert tokenizer_for(facts, here) == facts["tokenizer_folder"]
    proxied = Request({"type": "http", "client": ("127.0.0.1", 51000),
                       "headers": [(b"x-forwarded-for", b"203.0.113.9")]})   # a reverse proxy on this machine
    assert tokenizer_for(facts, proxied) == ALIAS_HUB_IDS["smollm2-135m"]
    assert tokenizer_for({**facts, "tokenizer_folder": str(tmp_path / "not-on-this-machine")}, here) == \
        ALIAS_HUB_IDS["smollm2-135m"]   # a trainer on another node: its folder is not here


def test_a_checkpoints_time_to_live_and_metadata_are_kept_and_it_is_deleted_when_it_expires(sdk_server, ledger_clock):
    """save_state and save_weights_for_sampler with `ttl_seconds` and `user_metadata` through the SDK: the RestClient
    lists them with their expiry and metadata; a time to live outside the SDK's range is refused, naming it; once the
    clock passes a checkpoint's expiry its files are deleted, it is no longer listed, and loading or sampling it
    says when it expired; a restarted server's ledger still knows. A checkpoint saved without one stays."""
    from orchestrator.tinker import checkpoint_ledger

    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    hour = training.save_state("hour", ttl_seconds=3600, user_metadata={"note": "first"}).result()
    kept = training.save_state("kept").result()
    sampler = training.save_weights_for_sampler("two-hours", ttl_seconds=7200).result()
    with pytest.raises(tinker.APIStatusError, match=r"ttl_seconds is 60: .* between 3600 \(1 hour\) and"):
        training.save_state("brief", ttl_seconds=60).result()
    rest = client.create_rest_client()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert set(listed) == {hour.path, kept.path, sampler.path}
    assert abs(listed[hour.path].expires_at.timestamp() - (ledger_clock[0] + 3600)) < 1
    assert listed[hour.path].user_metadata == {"note": "first"}
    assert listed[kept.path].expires_at is None and listed[kept.path].user_metadata is None
    sampling = client.create_sampling_client(model_path=sampler.path)   # a session on it, before it expires

    ledger_clock[0] += 3601
    listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {kept.path, sampler.path}
    assert not (backend.folder(training.model_id) / "weights" / "hour").exists()
    with pytest.raises(tinker.NotFoundError, match=r"expired at .* \(the ttl_seconds it was saved with\)"):
        client.create_training_client_from_state(hour.path).result()

    ledger_clock[0] += 3600
    backend.sweep_expired()
    assert sampler.path not in backend.book.samplers   # its frozen copy left the base
    assert not (backend.folder(training.model_id) / "sampler_weights" / "two-hours").exists()
    with pytest.raises(tinker.NotFoundError, match="expired at"):
        client.create_sampling_client(model_path=sampler.path).sample(
            types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    del sampling
    ledger = checkpoint_ledger.CheckpointLedger(backend.weights_dir)   # as a restarted server reads it
    assert ledger.gone_note(hour.path, "alice") is not None and ledger.due() == []
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [kept.path]
    client.close("success").result()


def test_a_published_checkpoint_is_loaded_and_sampled_by_another_user_and_its_ttl_is_set(sdk_server, ledger_clock):
    """The RestClient's publish / unpublish and set_checkpoint_ttl through the SDK: another user gets 404 for an
    unpublished checkpoint; once published, they read its weights info, sample its sampler weights (what its owner
    samples) and create a training client from its state (its weights), but cannot list, publish or delete it;
    publishing twice or unpublishing a private one is 409; after unpublishing, it is 404 to them again. A time to
    live set later is listed and deletes the checkpoint when it passes; None removes it; one out of range is 400."""
    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("shared").result()
    sampler = training.save_weights_for_sampler("shared").result()
    prompt = [5, 17, 3, 99]
    owners = greedy(alice.create_sampling_client(model_path=sampler.path), prompt)
    rest = alice.create_rest_client()
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob_rest = bob.create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        greedy(bob.create_sampling_client(model_path=sampler.path), prompt)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state.path).result()

    for path in (state.path, sampler.path):
        rest.publish_checkpoint_from_tinker_path(path).result()
    # 409 as Tinker documents it; asked directly, since the SDK retries a 409 for five minutes before raising it
    publish_url = f"{url}/api/v1/training_runs/{training.model_id}/checkpoints/weights/shared/publish"
    again = httpx.post(publish_url, headers={"X-API-Key": "tml-alice-token"})
    assert again.status_code == 409 and "public already" in again.json()["detail"]
    with pytest.raises(tinker.NotFoundError):
        bob_rest.publish_checkpoint_from_tinker_path(state.path).result()
    listed = {c.tinker_path: c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {state.path: True, sampler.path: True}
    assert bob_rest.get_weights_info_by_tinker_path(state.path).result().lora_rank == 4
    same_samples(greedy(bob.create_sampling_client(model_path=sampler.path), prompt), owners)
    loaded = bob.create_training_client_from_state(state.path).result()
    mine = saved_weights(backend, loaded.save_weights_for_sampler("copy").result().path)
    theirs = saved_weights(backend, sampler.path)
    assert set(mine) == set(theirs) and all(torch.equal(mine[name], theirs[name]) for name in theirs)
    assert bob_rest.list_user_checkpoints().result().checkpoints[0].tinker_path.startswith(f"tinker://{loaded.model_id}")
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(state.path).result()

    rest.unpublish_checkpoint_from_tinker_path(state.path).result()
    again = httpx.delete(publish_url, headers={"X-API-Key": "tml-alice-token"})
    assert again.status_code == 409 and "private already" in again.json()["detail"]
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(state.path).result()

    rest.set_checkpoint_ttl_from_tinker_path(state.path, 7200).result()
    checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
    (listed,) = [c for c in checkpoints if c.tinker_path == state.path]
    assert abs(listed.expires_at.timestamp() - (ledger_clock[0] + 7200)) < 1
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds is 5: .* between 3600"):
        rest.set_checkpoint_ttl_from_tinker_path(state.path, 5).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler.path, 3600).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler.path, None).result()
    ledger_clock[0] += 7201
    listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed == {sampler.path}   # the state expired; the sampler's time to live was removed
    alice.close("success").result()
    bob.close("success").result()


def test_a_front_deletes_expired_checkpoints_without_waiting_for_a_request(tmp_path, monkeypatch, caplog, ledger_clock):
    """A front whose weights folder is asked of its service (as `aspen http`'s is), started after a checkpoint's
    time to live passed: its reaper finds the folder by itself and deletes the checkpoint, no request needed; while
    the service does not answer, it says so and tries again."""
    from orchestrator.tinker import tinker_backend
    from orchestrator.tinker.rest_routes import saved_checkpoints

    monkeypatch.setattr(tinker_backend, "REAP_EVERY_S", 0.02)
    monkeypatch.setattr(tinker_backend, "FIND_FOLDER_EVERY_S", 0.1)
    weights = tmp_path / "weights"
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, weights, KEYS.get,
                           window_s=WINDOW_S) as (url, _, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        state = training.save_state("brief", ttl_seconds=3600).result()
        kept = training.save_state("kept").result()
        client.close("success").result()
    ledger_clock[0] += 3601
    answers = iter([RuntimeError("the service did not answer")])

    def folder() -> Path:   # the service's answer; its first try fails
        failure = next(answers, None)
        if failure is not None:
            raise failure
        return weights

    backend = TinkerBackend(InteractiveCalls(from_module(tiny_model("llama", VOCAB), None)), BASE, folder,
                            KEYS.get)
    with caplog.at_level("WARNING", logger="orchestrator.tinker.tinker_backend"):
        backend.start()
        try:
            deadline = time.monotonic() + 30
            while len(list(saved_checkpoints(weights))) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            backend.close()
    left = [f"tinker://{facts['model_id']}/{kind}/{name}" for facts, _, kind, name in saved_checkpoints(weights)]
    assert left == [kept.path] and state.path != kept.path
    assert "the weights folder is not known yet (the service did not answer)" in caplog.text


def test_the_rest_client_pages_a_users_runs_and_lists_their_sessions(sdk_server):
    """list_training_runs through the SDK: the user's runs, the most recent first, a page at a time with the total;
    with access_scope="accessible" also another user's run that has a published checkpoint (that one alone);
    list_sessions and get_session: the user's sessions (live and ended), each one's runs, samplers, metadata and
    name; another user's session is 404, and a project_id (aspen has none) is refused, saying so."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(user_metadata={"team": "a"}, display_name="first", base_url=url,
                                 api_key="tml-alice-token")
    runs = [alice.create_lora_training_client(base_model=BASE, rank=4).result() for _ in range(3)]
    for index, run in enumerate(runs):   # each run's checkpoint later than the one before
        run.save_state(f"state-{index}").result()
        time.sleep(0.02)
    sampler_path = runs[0].save_weights_for_sampler("s").result().path
    sampling = alice.create_sampling_client(model_path=sampler_path)
    greedy(sampling, [5, 17])
    rest = alice.create_rest_client()
    first = rest.list_training_runs(limit=2).result()
    assert first.cursor.total_count == 3 and first.cursor.limit == 2
    rest_of = rest.list_training_runs(limit=2, offset=2).result()
    listed = [r.training_run_id for r in first.training_runs + rest_of.training_runs]
    assert listed == [runs[0].model_id, runs[2].model_id, runs[1].model_id]   # run 0's sampler save is the latest
    assert all(r.model_owner == "alice" and r.lora_rank == 4 for r in first.training_runs)
    with pytest.raises(tinker.UnprocessableEntityError, match="aspen has no projects"):
        rest.list_training_runs(project_id="p").result()

    session_id = runs[0].model_id.split(":train:")[0]
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob_rest = bob.create_rest_client()
    bob_run = bob.create_lora_training_client(base_model=BASE, rank=2).result()
    published = bob_run.save_state("shared").result()
    bob_run.save_state("private").result()
    bob_rest.publish_checkpoint_from_tinker_path(published.path).result()
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == listed
    everyone = rest.list_training_runs(access_scope="accessible").result().training_runs
    accessible = {r.training_run_id: r for r in everyone}
    assert set(accessible) == {*listed, bob_run.model_id}
    assert accessible[bob_run.model_id].model_owner == "bob"
    assert accessible[bob_run.model_id].last_checkpoint.tinker_path == published.path

    info = rest.get_session(session_id).result()
    assert info.training_run_ids == [run.model_id for run in runs] and len(info.sampler_ids) == 1
    assert info.user_metadata == {"team": "a"} and info.display_name == "first"
    assert rest.list_sessions().result().sessions == [session_id]
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_session(session_id).result()
    alice.close("success").result()
    again = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    again.create_lora_training_client(base_model=BASE, rank=4).result()
    again_rest = again.create_rest_client()
    sessions = again_rest.list_sessions().result().sessions
    assert len(sessions) == 2 and sessions[1] == session_id   # the newest first; the ended one still listed
    assert again_rest.get_session(session_id).result().training_run_ids == [run.model_id for run in runs]
    again.close("success").result()
    bob.close("success").result()


def test_external_weights_are_the_merged_model_downloaded_through_signed_urls(tmp_path, monkeypatch, tiny_model_dirs):
    """save_weights_external and get_external_weights_urls through the SDK, on a base read from a folder: the files
    the signed URLs download (no key) load with transformers' from_pretrained and give PEFT's logits of the same
    adapter (its sampler weights) on the base, within float32's rounding of a merge; the checkpoint is listed as
    "external"; another user gets 404, a changed or expired URL 403 (a URL signs its own file only), and age
    encryption is refused (422), naming it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.engine.models import load_base_model
    from orchestrator.tinker import external_weights

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    with tinker_in_process(base, BASE, tmp_path / "weights", KEYS.get, window_s=WINDOW_S) as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        train_steps(training, (1, 2))
        sampler = training.save_weights_for_sampler("s").result()
        external = training.save_weights_external("hf").result()
        assert external.path == f"tinker://{training.model_id}/external_weights/hf"
        rest = client.create_rest_client()
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        kinds = {c.tinker_path: c.checkpoint_type for c in listed}
        assert kinds == {sampler.path: "sampler", external.path: "external"}
        urls = rest.get_external_weights_urls(external.path).result().urls
        assert {"config.json", "model.safetensors"} <= set(urls) and "aspen.json" not in urls
        downloaded = tmp_path / "downloaded"
        downloaded.mkdir()
        for name, link in urls.items():
            answer = httpx.get(link)
            assert answer.status_code == 200, (name, answer.text)
            (downloaded / name).write_bytes(answer.content)
        tampered = httpx.get(urls["config.json"].replace("signature=", "signature=0"))
        assert tampered.status_code == 403 and "not one aspen signed" in tampered.json()["detail"]
        other = httpx.get(urls["config.json"].replace("config.json", "model.safetensors"))
        assert other.status_code == 403   # a URL signs its own file only
        monkeypatch.setattr(external_weights, "URLS_VALID_S", -1)
        stale = httpx.get(rest.get_external_weights_urls(external.path).result().urls["config.json"])
        assert stale.status_code == 403 and "expired" in stale.json()["detail"]
        bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
        with pytest.raises(tinker.NotFoundError):
            bob.create_rest_client().get_external_weights_urls(external.path).result()
        with pytest.raises(tinker.APIStatusError, match="age_encryption_recipients"):
            training.save_weights_external("sealed", age_encryption_recipients=["age1abc"]).result()
        client.close("success").result()
        bob.close("success").result()
        folder = backend.weights_dir / training.model_id.replace(":", "-") / "sampler_weights" / "s"

    merged = AutoModelForCausalLM.from_pretrained(downloaded, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32), folder).eval()
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7]])
    with torch.no_grad():
        got, expected = merged(tokens).logits, reference(tokens).logits
        bare = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)(tokens).logits
    # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a relative error of a few float32
    # epsilons (1.2e-7) per layer, far below the adapter's own effect on the logits
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    assert float((expected - bare).abs().max()) > 1e-3 * scale


def test_a_base_that_cannot_be_merged_fails_that_external_save_alone(sdk_server):
    """A base built in memory has no files to merge into: save_weights_external fails, saying why (the base cannot
    be loaded), leaves nothing behind, and the model trains on."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match=r"external_weights/hf: merging the adapter into its base"):
        training.save_weights_external("hf").result()
    train_steps(training, (1,))   # the model goes on
    assert not list((sdk_server[1].folder(training.model_id) / "external_weights").glob("*"))
    client.close("success").result()


def refusal(ask, path: str) -> tuple[str, int, str]:
    """What the server answered `ask()` (its error's class, status and message, `path` in it as <path>, its
    checkpoint id as <id>)."""
    with pytest.raises(tinker.APIStatusError) as raised:
        ask()
    checkpoint_id = path.removeprefix("tinker://").split("/", 1)[1]
    text = str(raised.value).replace(path, "<path>").replace(checkpoint_id, "<id>")
    return type(raised.value).__name__, raised.value.status_code, text


def test_another_users_deleted_or_expired_checkpoint_is_answered_as_one_that_never_existed(sdk_server, ledger_clock):
    """Bob samples, loads, asks the weights info of and deletes Alice's checkpoints once she deleted them (one she had
    published, which Bob sampled) or they expired: each answer is, status and text, what he gets for a path of hers
    that never existed (he was told they were deleted, and when: that they existed). Alice is still told when and
    what to do (deleting one again too: it said "no checkpoint of yours")."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    saved = {"deleted": (training.save_weights_for_sampler("deleted").result().path,
                         training.save_state("deleted").result().path),
             "expired": (training.save_weights_for_sampler("expired", ttl_seconds=3600).result().path,
                         training.save_state("expired", ttl_seconds=3600).result().path)}
    never = (f"tinker://{training.model_id}/sampler_weights/never", f"tinker://{training.model_id}/weights/never")
    rest = alice.create_rest_client()
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob_training = bob.create_lora_training_client(base_model=BASE, rank=4).result()
    rest.publish_checkpoint_from_tinker_path(saved["deleted"][0]).result()
    bobs_session = bob.create_sampling_client(model_path=saved["deleted"][0])
    greedy(bobs_session, [5, 17, 3])

    def answers(client, training_client, sampler_path: str, state_path: str) -> list[tuple[str, int, str]]:
        return [
            refusal(lambda: greedy(client.create_sampling_client(model_path=sampler_path), [5, 17, 3]), sampler_path),
            refusal(lambda: training_client.load_state(state_path).result(), state_path),
            refusal(lambda: client.create_training_client_from_state(state_path).result(), state_path),
            *(refusal(lambda p=path: client.create_rest_client().get_weights_info_by_tinker_path(p).result(), path)
              for path in (sampler_path, state_path)),
            *(refusal(lambda p=path: client.create_rest_client().delete_checkpoint_from_tinker_path(p).result(), path)
              for path in (sampler_path, state_path))]

    never_existed = answers(bob, bob_training, *never)
    assert {status for _, status, _ in never_existed} == {404}
    for path in saved["deleted"]:
        rest.delete_checkpoint_from_tinker_path(path).result()
    ledger_clock[0] += 3601
    for gone in ("deleted", "expired"):
        assert answers(bob, bob_training, *saved[gone]) == never_existed, gone
    assert refusal(lambda: greedy(bobs_session, [5, 17, 3]), saved["deleted"][0]) == never_existed[0]

    owners = answers(alice, training, *saved["deleted"]) + answers(alice, training, *saved["expired"])
    assert all("was deleted by its owner (delete_checkpoint) at" in text for _, _, text in owners[:7])
    assert all("expired at" in text and "ttl_seconds" in text for _, _, text in owners[7:])
    alice.close("success").result()
    bob.close("success").result()


def test_a_training_runs_user_metadata_is_kept_as_the_cookbook_reads_it(sdk_server):
    """The `user_metadata` a run is created with (create_lora_training_client's, create_training_client_from_state's:
    the cookbook's recipes put their renderer's name there) is the run's in get_training_run and list_training_runs,
    read back by the cookbook's own get_renderer_name_from_checkpoint, after the model ended and on a restarted
    server too (it was dropped: None, and the cookbook logged the checkpoint had no renderer metadata). A value
    other than a string is refused, naming its key."""
    checkpoint_utils = pytest.importorskip("tinker_cookbook.checkpoint_utils")
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4,
                                                  user_metadata={"renderer_name": "qwen3_instruct"}).result()
    state = training.save_state("first").result()
    resumed = client.create_training_client_from_state(state.path, user_metadata={"renderer_name": "role_colon"}
                                                       ).result()
    sampler = resumed.save_weights_for_sampler("resumed").result()
    plain = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.UnprocessableEntityError, match=r"user_metadata\['step'\] is 3: .* strings"):
        client.create_lora_training_client(base_model=BASE, rank=4, user_metadata={"step": 3}).result()
    expected = {training.model_id: {"renderer_name": "qwen3_instruct"},
                resumed.model_id: {"renderer_name": "role_colon"}, plain.model_id: None}

    def seen(address: str) -> None:
        service = tinker.ServiceClient(base_url=address, api_key="tml-alice-token")
        assert checkpoint_utils.get_renderer_name_from_checkpoint(service, state.path) == "qwen3_instruct"
        assert checkpoint_utils.get_renderer_name_from_checkpoint(service, sampler.path) == "role_colon"
        runs = service.create_rest_client().list_training_runs().result().training_runs
        listed = {run.training_run_id: run.user_metadata for run in runs if run.training_run_id in expected}
        assert listed == {run_id: expected[run_id] for run_id in listed}
        assert {training.model_id, resumed.model_id} <= set(listed)
        service.close("success").result()

    seen(url)
    client.close("success").result()   # the models end; their runs are read from their folders
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, backend.weights_dir, KEYS.get,
                           window_s=WINDOW_S) as (restarted, _, _):
        seen(restarted)


def test_the_rest_client_pages_a_users_checkpoints_the_newest_first(sdk_server):
    """list_user_checkpoints as the SDK documents it: the user's checkpoints of all their runs sorted by time, the
    newest first, `limit` of them from `offset`, with the cursor's total (every one was answered at once, states
    before sampler weights, whatever the limit, with no cursor). The times are the ones set on the files."""
    import os

    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    saved = []
    for _ in range(2):
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        saved += [training.save_state("a").result().path, training.save_weights_for_sampler("b").result().path,
                  training.save_state("c").result().path]
    moments = {path: 1_700_000_000 + 60 * index for index, path in enumerate([saved[i] for i in (4, 0, 5, 2, 1, 3)])}
    for path, moment in moments.items():
        model_id, kind, name = path.removeprefix("tinker://").split("/")
        os.utime(backend.folder(model_id) / kind / name, (moment, moment))
    newest_first = sorted(moments, key=moments.get, reverse=True)
    rest = client.create_rest_client()
    pages = [rest.list_user_checkpoints(limit=4, offset=offset).result() for offset in (0, 4)]
    assert [c.tinker_path for page in pages for c in page.checkpoints] == newest_first
    assert [len(page.checkpoints) for page in pages] == [4, 2]
    assert all(page.cursor.total_count == 6 and page.cursor.limit == 4 for page in pages)
    assert [c.time.timestamp() for c in pages[0].checkpoints] == [moments[p] for p in newest_first[:4]]
    client.close("success").result()
