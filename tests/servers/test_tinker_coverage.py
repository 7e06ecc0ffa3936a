"""The SDK's client surface on aspen (docs/tinker_coverage.md's table), through the real `tinker` SDK (0.38): the calls
tinker-cookbook or a user's own loop makes that no other test ran (RestClient.get_training_run_by_tinker_path,
get_sampler, delete_checkpoint, SamplingClient.get_base_model, a sampling client passed to another process by its
handle or pickled, TrainingClient.load_state_with_optimizer), answered with the SDK's types, and the calls that make
no sense on aspen (unserved_routes.py), each raising the SDK's error type with why and what to use instead. The
references: the sampling client the handle was taken from, a training client created from the same state by another
call, the SDK's own types."""

from __future__ import annotations

import pickle
from datetime import date

import httpx
import pytest

from tests.helpers.tinker_sdk import datums

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tinker import types  # noqa: E402

from tests.helpers.tinker_api import ADAM, BASE, batch, greedy, same_samples, train_steps  # noqa: E402

PROMPT = [5, 17, 3]


def test_the_cookbooks_lookups_and_a_sampler_passed_to_another_process(sdk_server):
    """get_training_run_by_tinker_path (what the cookbook's evaluators ask of a checkpoint: its run's base) answers
    the run get_training_run answers; get_sampler and get_base_model name the sampler's base and path in the SDK's
    type (before, get_sampler's answer was a plain dict that the SDK's type happened to read); a sampling client
    rebuilt from its handle (SamplingClient.from_sampler_handle, for a worker process) or from a pickle samples what
    the original does."""
    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("s").result().path
    sampler_path = training.save_weights_for_sampler("w").result().path
    rest = alice.create_rest_client()

    run = rest.get_training_run_by_tinker_path(state).result()
    assert isinstance(run, types.TrainingRun) and run == rest.get_training_run(training.model_id).result()
    assert (run.base_model, run.model_owner, run.lora_rank) == (BASE, "alice", 4)

    sampler = alice.create_sampling_client(model_path=sampler_path).result()
    assert sampler.get_base_model() == BASE
    found = rest.get_sampler(sampler._sampling_session_id).result()
    assert isinstance(found, types.GetSamplerResponse)
    assert (found.sampler_id, found.base_model, found.model_path) == (sampler._sampling_session_id, BASE,
                                                                       sampler_path)
    reference = greedy(sampler, PROMPT)
    handle = sampler.get_sampler_handle()
    assert "alice-token" not in handle   # the handle carries no credentials: the new client brings its own
    for clone in (tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-alice-token"),
                  pickle.loads(pickle.dumps(sampler))):
        same_samples(greedy(clone, PROMPT), reference)
    with pytest.raises(tinker.NotFoundError):
        rest_bob = tinker.RestClient(base_url=url, api_key="tml-bob-token")
        rest_bob.get_sampler(sampler._sampling_session_id).result()
    rest.delete_checkpoint(training.model_id, "weights/s").result()   # by run and checkpoint id
    assert [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints] == \
        ["sampler_weights/w"]
    alice.close("success").result()


def test_load_state_with_optimizer_on_a_live_client_continues_as_a_client_created_from_the_state(sdk_server):
    """TrainingClient.load_state_with_optimizer, on a client that trained on since the save, continues as
    create_training_client_from_state_with_optimizer's client does (the same loss after the same step);
    load_state (weights only) scores the state's loss."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1, 2))
    state = training.save_state("s").result().path
    train_steps(training, (3, 4))
    fresh = alice.create_training_client_from_state_with_optimizer(state).result()

    def next_loss(client) -> float:
        client.forward_backward(datums(batch(5)), "cross_entropy").result()
        client.optim_step(types.AdamParams(**ADAM)).result()
        return client.forward(datums(batch(6)), "cross_entropy").result().metrics["loss:sum"]

    assert isinstance(training.load_state_with_optimizer(state).result(), types.LoadWeightsResponse)
    assert next_loss(training) == next_loss(fresh)
    training.load_state(state).result()
    weights_only = alice.create_training_client_from_state(state).result()
    assert training.forward(datums(batch(7)), "cross_entropy").result().metrics["loss:sum"] == \
        weights_only.forward(datums(batch(7)), "cross_entropy").result().metrics["loss:sum"]
    alice.close("success").result()


def test_calls_that_make_no_sense_on_aspen_say_why_and_what_to_use(sdk_server):
    """Before, each of these was 404 'Not Found' (search_sessions: 405 'Method Not Allowed'), read as a missing
    session. Now each raises the SDK's error type with why and what aspen offers instead, at once (no status the
    SDK retries). whoami is the SDK's own: it reads a JWT aspen does not issue, asking nothing of the server."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    alice.create_lora_training_client(base_model=BASE, rank=4).result()
    rest = alice.create_rest_client()
    admin = tinker.AdminClient(base_url=url, api_key="tml-alice-token")
    (session_id,) = rest.list_sessions().result().sessions
    with pytest.raises(tinker.UnprocessableEntityError, match="aspen has no projects"):
        rest.assign_session_project(session_id, "p").result()
    with pytest.raises(tinker.BadRequestError, match=r"GET /v1/audit .*for admins"):
        admin.get_audit_log(day=date.today()).result()
    with pytest.raises(tinker.BadRequestError, match=r"GET /v1/accounts.*get_current_checkpoint_storage_usage"):
        admin.get_billing_usage("2026-01-01", "2026-02-01").result()
    with pytest.raises(tinker.BadRequestError, match=r"no Perfetto traces.*aspen status JOB"):
        rest.export_session_trace(session_id).result()
    with pytest.warns(tinker.ExperimentalWarning), pytest.raises(tinker.BadRequestError, match="list_sessions"):
        rest.search_sessions(types.SessionSearchRequest()).result()
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
        rest.whoami().result()
    health = httpx.get(f"{url}/api/v1/healthz")
    assert health.status_code == 200 and types.HealthResponse.model_validate(health.json()).status == "ok"
    alice.close("success").result()


def test_another_users_published_run_is_answered_with_access_scope_accessible(sdk_server):
    """get_training_run[_by_tinker_path](access_scope="accessible"), which the SDK sends as a query parameter: before,
    aspen ignored it, and Bob's lookup of the run of a checkpoint Alice published (what the cookbook asks of a
    checkpoint before sampling it: its base, its renderer in user_metadata) was 404, though his
    list_training_runs(access_scope="accessible") listed that run. Now it answers the run as that listing does;
    "owned" (the default) stays 404 to him, and so does "accessible" once she unpublishes."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = alice.create_lora_training_client(base_model=BASE, rank=4,
                                                 user_metadata={"renderer_name": "role_colon"}).result()
    state = training.save_state("s").result().path
    training.save_state("private").result()
    alice.close("success").result()
    rests = {user: tinker.RestClient(base_url=url, api_key=f"tml-{user}-token") for user in ("alice", "bob")}
    rests["alice"].publish_checkpoint_from_tinker_path(state).result()
    (listed,) = [run for run in rests["bob"].list_training_runs(access_scope="accessible").result().training_runs
                 if run.training_run_id == training.model_id]
    run = rests["bob"].get_training_run_by_tinker_path(state, access_scope="accessible").result()
    assert run == listed and (run.model_owner, run.base_model) == ("alice", BASE)
    assert run.user_metadata == {"renderer_name": "role_colon"}   # what the cookbook's get_renderer_name reads
    assert run.last_checkpoint.tinker_path == state   # her published checkpoint alone
    assert rests["alice"].get_training_run(training.model_id, access_scope="accessible").result().last_checkpoint \
        .tinker_path != state   # hers: every checkpoint of it
    with pytest.raises(tinker.NotFoundError):
        rests["bob"].get_training_run_by_tinker_path(state).result()
    rests["alice"].unpublish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        rests["bob"].get_training_run_by_tinker_path(state, access_scope="accessible").result()


def test_list_sessions_and_get_session_take_the_access_scope_as_list_training_runs_does(sdk_server):
    """list_sessions / get_session(access_scope=...), which the SDK sends as a query parameter: before, aspen ignored
    it (any value, even one the API does not have, listed the caller's own sessions), though
    list_training_runs(access_scope="accessible") lists Alice's published run to Bob. Now "accessible" also lists
    and answers another user's session holding a run that list_training_runs(access_scope="accessible") lists to him
    (the reference), with those runs alone and no samplers; "owned" stays his own; another value is 422."""
    url, _, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token", display_name="alice's")
    shared_run, private_run = (alice.create_lora_training_client(base_model=BASE, rank=4).result() for _ in range(2))
    state = shared_run.save_state("s").result().path
    private_run.save_state("p").result()
    shared_run.save_weights_and_get_sampling_client()
    other = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")   # her session with nothing published
    other.create_lora_training_client(base_model=BASE, rank=4).result().save_state("q").result()
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    bob.create_lora_training_client(base_model=BASE, rank=4).result()
    rests = {user: tinker.RestClient(base_url=url, api_key=f"tml-{user}-token") for user in ("alice", "bob")}
    rests["alice"].publish_checkpoint_from_tinker_path(state).result()
    session_of = {"alice": shared_run.model_id.split(":train:")[0], "bob": bob.holder.get_session_id()}

    runs = rests["bob"].list_training_runs(access_scope="accessible").result().training_runs
    theirs = {run.training_run_id.split(":train:")[0]: run.training_run_id for run in runs if run.model_owner != "bob"}
    assert theirs == {session_of["alice"]: shared_run.model_id}
    assert rests["bob"].list_sessions().result().sessions == [session_of["bob"]]
    assert rests["bob"].list_sessions(access_scope="accessible").result().sessions == \
        [session_of["bob"], session_of["alice"]]   # the newest first
    seen = rests["bob"].get_session(session_of["alice"], access_scope="accessible").result()
    assert (seen.training_run_ids, seen.sampler_ids, seen.display_name) == ([shared_run.model_id], [], "alice's")
    own = rests["alice"].get_session(session_of["alice"], access_scope="accessible").result()
    assert own.training_run_ids == [shared_run.model_id, private_run.model_id] and len(own.sampler_ids) == 1
    with pytest.raises(tinker.NotFoundError):
        rests["bob"].get_session(session_of["alice"]).result()
    with pytest.raises(tinker.NotFoundError):
        rests["bob"].get_session(other.holder.get_session_id(), access_scope="accessible").result()
    with pytest.raises(tinker.UnprocessableEntityError, match="access_scope 'everything'"):
        rests["bob"].list_sessions(access_scope="everything").result()
    rests["alice"].unpublish_checkpoint_from_tinker_path(state).result()
    assert rests["bob"].list_sessions(access_scope="accessible").result().sessions == [session_of["bob"]]
    for client in (alice, other, bob):
        client.close("success").result()
