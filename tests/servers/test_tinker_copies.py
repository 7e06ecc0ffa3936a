"""The SDK's `copy_weights` and checkpoint storage usage on aspen (copy_routes.py), through the real `tinker` SDK
(0.38: RestClient.copy_weights, ServiceClient.copy_weights, AdminClient.get_current_checkpoint_storage_usage). Before,
each was answered 404 'Not Found'. The references: the source checkpoint itself (a copy samples and scores as it
does) and the files on disk (the storage usage)."""

from __future__ import annotations

import errno
import subprocess

import httpx
import pytest

from tests.helpers.tinker_sdk import datums

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import BASE, batch, greedy, same_samples, train_steps  # noqa: E402


def scored(client, path: str) -> float:
    """The loss of one batch under the state at `path` (a training client created from it)."""
    training = client.create_training_client_from_state(path).result()
    return training.forward(datums(batch(5)), "cross_entropy").result().metrics["loss:sum"]


def on_disk(backend, run_ids) -> tuple[int, int]:
    """(how many checkpoints, their files' bytes) under the runs' folders, as the files are."""
    folders = [folder for run in run_ids for kind in ("weights", "sampler_weights")
               for folder in (backend.folder(run) / kind).glob("*") if not folder.name.startswith(".")]
    return len(folders), sum(f.stat().st_size for folder in folders for f in folder.iterdir() if f.is_file())


def test_copy_weights_copies_a_readable_checkpoint_into_a_new_run_of_the_caller(sdk_server, ledger_clock):
    """Alice copies her state (RestClient, any project: aspen has none) and her sampler weights (ServiceClient with
    a project): each copy is a new run of hers whose checkpoint scores and samples as its source, with its own
    time to live and its source's metadata, and outlives its source's deletion. A retry with the SDK's idempotency
    key answers the same copy. Bob copies her state only once she published it, into a run of his. A weights access
    token, a time to live out of range, external weights: 422 saying what to do."""
    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token", project_id="archive")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("s", user_metadata={"renderer_name": "role_colon"}).result().path
    sampler = training.save_weights_for_sampler("w").result().path
    rest = tinker.RestClient(base_url=url, api_key="tml-alice-token")

    state_copy = rest.copy_weights(state, "any-project", ttl_seconds=7200).result()
    sampler_copy = alice.copy_weights(sampler).result()
    assert state_copy.endswith("/weights/s") and sampler_copy.endswith("/sampler_weights/w")
    assert scored(alice, state_copy) == scored(alice, state)
    reference = greedy(alice.create_sampling_client(model_path=sampler), [5, 17, 3])
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    same_samples(greedy(alice.create_sampling_client(model_path=sampler_copy), [5, 17, 3]), reference)
    copy_run = state_copy.removeprefix("tinker://").split("/")[0]
    (listed,) = rest.list_checkpoints(copy_run).result().checkpoints
    assert listed.tinker_path == state_copy and listed.user_metadata == {"renderer_name": "role_colon"}
    assert abs(listed.expires_at.timestamp() - (ledger_clock[0] + 7200)) < 1
    assert rest.get_training_run(copy_run).result().model_owner == "alice"
    assert {c.tinker_path: c.expires_at for c in rest.list_checkpoints(training.model_id).result().checkpoints
            } == {state: None}

    def posted(key: str, **body) -> httpx.Response:
        return httpx.post(f"{url}/api/v1/copy_weights", json={"source_path": state, **body},
                          headers={"X-API-Key": "tml-alice-token", "X-Idempotency-Key": key})
    first, retried, other = posted("k1"), posted("k1"), posted("k2")
    assert first.json() == retried.json() != other.json() and first.status_code == 200

    bob = tinker.RestClient(base_url=url, api_key="tml-bob-token")
    with pytest.raises(tinker.NotFoundError):
        bob.copy_weights(state, "p").result()
    rest.publish_checkpoint_from_tinker_path(state).result()
    bobs = bob.copy_weights(state, "p").result()
    assert bob.get_training_run(bobs.removeprefix("tinker://").split("/")[0]).result().model_owner == "bob"
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(bobs.removeprefix("tinker://").split("/")[0]).result()

    with pytest.raises(tinker.UnprocessableEntityError, match="no weights access tokens.*publish"):
        rest.copy_weights(state, "p", weights_access_token="secret").result()
    with pytest.raises(tinker.UnprocessableEntityError, match="ttl_seconds is 5"):
        rest.copy_weights(state, "p", ttl_seconds=5).result()
    with pytest.raises(tinker.UnprocessableEntityError, match="save_weights_external's are not"):
        rest.copy_weights(f"tinker://{training.model_id}/external_weights/hf", "p").result()
    alice.close("success").result()


def test_the_checkpoint_storage_usage_is_the_users_own_checkpoints(sdk_server):
    """AdminClient.get_current_checkpoint_storage_usage (and the RestClient's deprecated call of it): one row, the
    caller's, with the count and bytes of their checkpoints as the files on disk hold them (another user's not
    counted); a project_id is 422 (aspen has no projects)."""
    url, backend, _ = sdk_server
    runs = {}
    for user, saves in (("alice", 2), ("bob", 1)):
        client = tinker.ServiceClient(base_url=url, api_key=f"tml-{user}-token")
        training = client.create_lora_training_client(base_model=BASE, rank=4).result()
        runs[user] = training.model_id
        for index in range(saves):
            training.save_state(f"s{index}").result()
            training.save_weights_for_sampler(f"w{index}").result()
        client.close("success").result()
    for user, saves in (("alice", 2), ("bob", 1)):
        admin = tinker.AdminClient(base_url=url, api_key=f"tml-{user}-token")
        (row,) = admin.get_current_checkpoint_storage_usage().result().data
        count, size = on_disk(backend, [runs[user]])
        assert (row.user_name, row.checkpoint_count, row.size_bytes, row.size_gigabytes) == \
            (user, 2 * saves, size, size / 1e9) and count == 2 * saves
    with pytest.warns(FutureWarning):
        rest = tinker.RestClient(base_url=url, api_key="tml-alice-token")
        assert rest.get_current_checkpoint_storage_usage().result().data == \
            tinker.AdminClient(base_url=url, api_key="tml-alice-token").get_current_checkpoint_storage_usage(
            ).result().data
    with pytest.raises(tinker.UnprocessableEntityError, match="aspen has no projects"):
        tinker.AdminClient(base_url=url, api_key="tml-alice-token").get_current_checkpoint_storage_usage(
            "proj").result()


def test_a_copy_retried_after_a_restart_answers_the_first_copy_within_the_keys_bounds(tmp_path, monkeypatch,
                                                                                       ledger_clock):
    """The SDK sends one X-Idempotency-Key with a copy and each of its retries. Before, the keys lived in the
    server's memory only, never dropped: a retry after `aspen http` restarted made a second copy, and a long-lived
    server kept every key. Now a copy's run file records its key: the restarted server (a second one over the same
    weights folder) answers the retry with the first server's copy; memory keeps the keys of a day
    (copy_keys.KEY_TTL_S) and at most copy_keys.KEPT_KEYS of them, an older or pushed-out key copying again. The
    references: the first server's answer and the copies' folders on disk."""
    from tinker.lib.public_interfaces import rest_client as sdk_rest

    from orchestrator.tinker import copy_keys
    from tests.helpers.tinker_api import served_tiny_base

    key = ["k1"]   # what the SDK's copy_weights sends (its uuid4 of one copy, which its retries resend)
    monkeypatch.setattr(sdk_rest, "uuid", type("uuid", (), {"uuid4": staticmethod(lambda: key[0])}))

    def copies(backend) -> int:
        return len(list(backend.weights_dir.glob("copy-*/weights/s")))

    with served_tiny_base(tmp_path, monkeypatch) as (url, backend, _):
        alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        state = alice.create_lora_training_client(base_model=BASE, rank=4).result().save_state("s").result().path
        first = tinker.RestClient(base_url=url, api_key="tml-alice-token").copy_weights(state, "p").result()
        alice.close("success").result()
    with served_tiny_base(tmp_path, monkeypatch) as (url, backend, _):   # `aspen http` restarted
        rest = tinker.RestClient(base_url=url, api_key="tml-alice-token")
        assert rest.copy_weights(state, "p").result() == first and copies(backend) == 1
        monkeypatch.setattr(copy_keys, "KEPT_KEYS", 2)
        key[0] = "k2"
        second = rest.copy_weights(state, "p").result()
        key[0] = "k3"   # k1 (the oldest) pushed out of the two kept
        third = rest.copy_weights(state, "p").result()
        assert third not in (first, second) and copies(backend) == 3
        key[0] = "k1"
        assert rest.copy_weights(state, "p").result() != first and copies(backend) == 4
        key[0] = "k3"
        assert rest.copy_weights(state, "p").result() == third and copies(backend) == 4   # still kept
        ledger_clock[0] += copy_keys.KEY_TTL_S + 1   # a day later: too old
        assert rest.copy_weights(state, "p").result() != third and copies(backend) == 5


def du_bytes(*folders) -> list[int]:
    """coreutils `du`'s apparent bytes of each folder, a file linked into an earlier one counted there only (what
    the copies cost on disk, as du says it)."""
    out = subprocess.run(["du", "-sb", "--", *map(str, folders)], check=True, capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()]


def test_a_copy_links_its_sources_files_and_keeps_them_through_a_new_save_and_the_deletion(sdk_server, monkeypatch):
    """Before, a copy duplicated its source's files (du: the copy as large as its source). Now they are hard-linked
    where source and copy lie on one file system: `du` counts the copy's weights once, the copy costing only its own
    facts files. A later save under the source's name writes new files (never into the linked ones): the copy scores
    (a state) or samples (sampler weights) as the source did when copied, bytes for bytes, and goes on after the
    source's deletion. Where links are refused (another file system), the files are copied: the same scores, du
    counting them twice."""
    from orchestrator.tinker import copy_routes

    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token", project_id="p")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("s").result().path
    sampler = training.save_weights_for_sampler("w").result().path
    source = backend.folder(training.model_id) / "weights" / "s"
    before, sampled = scored(alice, state), greedy(alice.create_sampling_client(model_path=sampler), [5, 17, 3])
    linked = alice.copy_weights(state).result()
    sampler_copy = alice.copy_weights(sampler).result()
    copy_folder = backend.folder(linked.removeprefix("tinker://").split("/")[0]) / "weights" / "s"
    source_size, copy_extra = du_bytes(source, copy_folder)
    weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert copy_extra < source_size - weights + 4096, (source_size, copy_extra, weights)
    files = {f.name: f.read_bytes() for f in copy_folder.iterdir()}

    train_steps(training, (2,))
    assert training.save_state("s", overwrite=True).result().path == state   # a new save under its name
    assert training.save_weights_for_sampler("w").result().path == sampler   # the sampler weights' too
    assert scored(alice, state) != before
    same_samples(greedy(alice.create_sampling_client(model_path=sampler_copy), [5, 17, 3]), sampled)
    assert scored(alice, linked) == before and {f.name: f.read_bytes() for f in copy_folder.iterdir()} == files
    tinker.RestClient(base_url=url, api_key="tml-alice-token").delete_checkpoint_from_tinker_path(state).result()
    assert not source.exists() and scored(alice, linked) == before

    def refused(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link", source)
    monkeypatch.setattr(copy_routes.os, "link", refused)
    copied = alice.copy_weights(linked).result()
    copied_folder = backend.folder(copied.removeprefix("tinker://").split("/")[0]) / "weights" / "s"
    assert scored(alice, copied) == before
    linked_size, copied_extra = du_bytes(copy_folder, copied_folder)
    assert copied_extra > weights, (linked_size, copied_extra, weights)
    alice.close("success").result()


def test_two_users_same_idempotency_key_make_two_copies_each_their_own(sdk_server, monkeypatch):
    """The SDK's idempotency key is the user's: Alice and Bob copying Alice's published state with the same key get
    two copies, each a run of its copier (404 to the other); each one's retry answers their own copy."""
    from tinker.lib.public_interfaces import rest_client as sdk_rest

    monkeypatch.setattr(sdk_rest, "uuid", type("uuid", (), {"uuid4": staticmethod(lambda: "same-key")}))
    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    state = alice.create_lora_training_client(base_model=BASE, rank=4).result().save_state("s").result().path
    rests = {user: tinker.RestClient(base_url=url, api_key=f"tml-{user}-token") for user in ("alice", "bob")}
    rests["alice"].publish_checkpoint_from_tinker_path(state).result()
    copies = {user: rest.copy_weights(state, "p").result() for user, rest in rests.items()}
    assert copies["alice"] != copies["bob"] and len(list(backend.weights_dir.glob("copy-*/weights/s"))) == 2
    for user, other in (("alice", "bob"), ("bob", "alice")):
        run = copies[user].removeprefix("tinker://").split("/")[0]
        assert rests[user].get_training_run(run).result().model_owner == user
        with pytest.raises(tinker.NotFoundError):
            rests[other].get_training_run(run).result()
        assert rests[user].copy_weights(state, "p").result() == copies[user]   # the retry: the user's own copy
    assert len(list(backend.weights_dir.glob("copy-*/weights/s"))) == 2
    alice.close("success").result()


def test_the_sdk_asks_a_project_before_sending_a_copy_any_name_serves(sdk_server, monkeypatch):
    """aspen cannot give the SDK a default project: ServiceClient.copy_weights (and RestClient's without one) raise
    ValueError in the SDK, before any request, unless `project_id=` or TINKER_PROJECT_ID is set. Any value serves
    (aspen has no projects: the copy is the caller's)."""
    url, backend, _ = sdk_server
    monkeypatch.delenv("TINKER_PROJECT_ID", raising=False)
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    state = alice.create_lora_training_client(base_model=BASE, rank=4).result().save_state("s").result().path
    with pytest.raises(ValueError, match="TINKER_PROJECT_ID"):
        alice.copy_weights(state)
    assert not list(backend.weights_dir.glob("copy-*"))   # nothing reached the server
    monkeypatch.setenv("TINKER_PROJECT_ID", "anything")
    copied = alice.copy_weights(state).result()
    run = copied.removeprefix("tinker://").split("/")[0]
    assert tinker.RestClient(base_url=url, api_key="tml-alice-token").get_training_run(run).result().model_owner \
        == "alice"
    alice.close("success").result()


def du_files(*folders) -> int:
    """coreutils `du`'s apparent bytes of the files under `folders`, each file (inode) counted once however many
    of them link it: what the disk holds for them."""
    files = subprocess.run(["find", *map(str, folders), "-type", "f", "-print0"], check=True, capture_output=True
                           ).stdout
    out = subprocess.run(["du", "-cb", "--files0-from=-"], input=files, check=True, capture_output=True).stdout
    return int(out.decode().splitlines()[-1].split()[0])


def test_the_storage_usage_counts_a_copys_linked_files_once(sdk_server):
    """Before, a copy's files (hard links to its source's) counted in full in both checkpoints and in the storage
    usage: Alice's usage, with two copies of her state, said three states' bytes where the disk held one (a user
    near a quota refused for bytes not used). Now the usage counts each file once, as `du` of her checkpoints'
    files does (the reference); each checkpoint's own size_bytes stays its files' size (the SDK's "size of the
    checkpoint"), so the listed sizes add up to more. Bob's copy of her published state counts in his usage too
    (he holds those bytes: her deletion leaves them his)."""
    url, backend, _ = sdk_server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token", project_id="p")
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1,))
    state = training.save_state("s").result().path
    training.save_weights_for_sampler("w").result()
    first = alice.copy_weights(state).result()
    alice.copy_weights(first).result()   # a copy of the copy: the same files
    rest = tinker.RestClient(base_url=url, api_key="tml-alice-token")
    rest.publish_checkpoint_from_tinker_path(state).result()
    bobs = tinker.RestClient(base_url=url, api_key="tml-bob-token").copy_weights(state, "p").result()

    def usage(user: str) -> tuple[int, int]:
        (row,) = tinker.AdminClient(base_url=url, api_key=f"tml-{user}-token").get_current_checkpoint_storage_usage(
        ).result().data
        return row.checkpoint_count, row.size_bytes

    listed = rest.list_user_checkpoints().result().checkpoints
    folders = [backend.folder(c.tinker_path.removeprefix("tinker://").split("/")[0]) / c.checkpoint_id
               for c in listed]
    assert usage("alice") == (4, du_files(*folders))
    weights = sum(f.stat().st_size for f in (backend.folder(training.model_id) / "weights" / "s").glob("*.safetensors"))
    assert sum(c.size_bytes for c in listed) >= usage("alice")[1] + 2 * weights
    for checkpoint, folder in zip(listed, folders, strict=True):
        assert checkpoint.size_bytes == sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    bob_folder = backend.folder(bobs.removeprefix("tinker://").split("/")[0]) / "weights" / "s"
    assert usage("bob") == (1, du_files(bob_folder)) and usage("bob")[1] > weights
    alice.close("success").result()
