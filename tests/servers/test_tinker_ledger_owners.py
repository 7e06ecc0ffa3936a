"""A checkpoint ledger written before its entries named their owner (checkpoint_ledger.py), read by a restarted
server through the real `tinker` SDK: each user is answered as for the same checkpoints recorded by today's server
(the reference: the answers the server gave before the ledger was rewritten in the older format)."""

from __future__ import annotations

import json
import logging

import pytest

from actors.engine.models import from_module
from orchestrator.tinker.checkpoint_ledger import LEDGER_NAME
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import tinker_in_process

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import BASE, KEYS, WINDOW_S, greedy, served_tiny_base, train_steps  # noqa: E402


def told(ask) -> tuple[int, str] | str:
    """The status and message of the SDK's error for `ask()`, or "answered"."""
    try:
        ask()
    except tinker.APIStatusError as error:
        return error.status_code, str(error)
    return "answered"


def seen_by(url: str, paths: dict[str, str]) -> dict:
    """What Alice and Bob are answered for Alice's checkpoints: her listing (time to live, metadata, published),
    and each one's load, sampling and weights info, by each user."""
    seen: dict = {}
    for user in ("alice", "bob"):
        client = tinker.ServiceClient(base_url=url, api_key=f"tml-{user}-token")
        rest = client.create_rest_client()
        seen[user, "listed"] = sorted((c.tinker_path, c.public, c.expires_at, c.user_metadata)
                                      for c in rest.list_user_checkpoints().result().checkpoints)
        for name, path in paths.items():
            if "/weights/" in path:
                seen[user, name, "load"] = told(
                    lambda p=path, c=client: c.create_training_client_from_state(p).result())
            else:
                seen[user, name, "sample"] = told(
                    lambda p=path, c=client: greedy(c.create_sampling_client(model_path=p), [5, 17, 3]))
            seen[user, name, "info"] = told(lambda p=path, r=rest: r.get_weights_info_by_tinker_path(p).result())
        client.close("success").result()
    return seen


def test_a_ledger_without_owners_is_attributed_once_and_answered_as_todays(tmp_path, monkeypatch, caplog,
                                                                             ledger_clock):
    """Alice's published state with a time to live, a state she deleted and sampler weights that expired, in a
    ledger rewritten as aspen wrote it before entries named their owner (no `owner`), plus an entry of a run whose
    files are all gone: the restarted server tells Alice when she deleted one and when one expired, and lists the
    kept one's time to live, metadata and publishing, as before (it told her "no saved state ... of yours"); Bob
    loads the published one and is told of the others what he is told of a path that never existed. The entries
    name their owner from then on (the log says so once; a second restart says nothing), the one whose run is gone
    names none and is to Alice too a path that never existed."""
    with served_tiny_base(tmp_path, monkeypatch) as (url, backend, _):
        alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = alice.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        train_steps(training, (1,))
        paths = {"kept": training.save_state("kept", ttl_seconds=7200, user_metadata={"k": "v"}).result().path,
                 "deleted": training.save_state("deleted", user_metadata={"k": "w"}).result().path,
                 "expired": training.save_weights_for_sampler("expired", ttl_seconds=3600).result().path,
                 "never": f"tinker://{training.model_id}/weights/never"}
        rest = alice.create_rest_client()
        rest.publish_checkpoint_from_tinker_path(paths["kept"]).result()
        rest.delete_checkpoint_from_tinker_path(paths["deleted"]).result()
        ledger_clock[0] += 3601
        alice.close("success").result()
        reference = seen_by(url, paths)
        weights_dir = backend.weights_dir
    assert reference["alice", "expired", "sample"][1].count("expired at") == 1   # the reference is what it says
    assert reference["bob", "deleted", "load"][0] == 404 and reference["bob", "kept", "load"] == "answered"

    ledger_file = weights_dir / LEDGER_NAME
    entries = json.loads(ledger_file.read_text())
    assert all(entry.pop("owner") == "alice" for entry in entries.values())   # as aspen wrote it before
    orphan = "tinker://gone-session:train:0/weights/old"
    entries[orphan] = {"deleted_by_owner_at": ledger_clock[0] - 60}
    ledger_file.write_text(json.dumps(entries, indent=1, sort_keys=True))

    def restarted() -> tuple[dict, tuple[int, str] | str, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="orchestrator.tinker.checkpoint_ledger"), \
                tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, weights_dir, KEYS.get,
                                  window_s=WINDOW_S) as (url, _, _):
            seen = seen_by(url, paths)
            client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
            orphan_seen = told(lambda: client.create_training_client_from_state(orphan).result())
            client.close("success").result()
        # the ledger's records alone: after tinker-cookbook's test, the SDK logs at INFO too
        return seen, orphan_seen, [record.getMessage() for record in caplog.records
                                   if record.name == "orchestrator.tinker.checkpoint_ledger"]

    seen, orphan_seen, logged = restarted()
    assert seen == reference
    assert orphan_seen[0] == 404 and "no saved state" in orphan_seen[1] and "deleted" not in orphan_seen[1]
    assert len(logged) == 1 and "3 entries written before entries named their owner now name" in logged[0]
    assert "1 whose run's files are gone" in logged[0] and orphan in logged[0]
    owners = {path: entry["owner"] for path, entry in json.loads(ledger_file.read_text()).items()}
    assert owners == {paths["kept"]: "alice", paths["deleted"]: "alice", paths["expired"]: "alice", orphan: None}
    assert restarted() == (reference, orphan_seen, [])   # attributed once
