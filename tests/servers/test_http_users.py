"""Users over the HTTP API (actors/service/accounts/users.py), on a real server over a real service: each user
sees and acts on their own jobs only, reads data only under their data roots, gets a fair share of the
trainer, and a server over a running service reads that service's users file. The Ray client's view of the
same service is the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook
from orchestrator.client import Client
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import Conflict, HttpClient, QuotaExceeded, SpecRefused
from tests.helpers.http_server import NOBODYS_MODEL, root_alice_bob, running_server
from tests.helpers.service import job_dict, wait_for, write_task_data

REPO = Path(__file__).resolve().parents[2]


def test_each_user_sees_and_acts_on_their_own_jobs_only(api, users, tmp_path):
    """Users of a users file (actors/service/accounts/users.py): another user's job answers exactly as an unknown one on
    every endpoint and is in none of the lists, snapshots or streams; its name is taken without saying whose;
    an admin sees it; a rotated or removed token is refused from the next request on; every action is in the
    audit log, which only admins read. The Ray client's record (the reference) names the job's owner, and the
    job writes under the outputs' folder of its user."""
    audit = AuditLog.in_state_dir(tmp_path / "audit")
    data = write_task_data(tmp_path / "data", "own")
    root, alice, bob = root_alice_bob(users, tmp_path / "data")
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users, audit=audit)
    with running_server(app) as url:
        raw = httpx.Client(base_url=url, timeout=60)

        def get(path: str, token: str) -> httpx.Response:
            return raw.get(path, headers={"Authorization": f"Bearer {token}"})

        assert get("/v1/jobs", api.token).status_code == 401        # with users, the single token is no one's
        as_alice, as_bob, as_root = HttpClient(url, alice), HttpClient(url, bob), HttpClient(url, root)
        bobs_stream = as_bob.events(timeout=60)
        assert next(bobs_stream).kind == "snapshot"
        job = as_alice.submit(job_dict("alices-job", data, 2), base_model=NOBODYS_MODEL)
        assert api.ray.status(job.id).user == "alice"
        assert api.ray.status(job.id).output_dir == str((api.state_dir / "outputs" / "alice" / job.id).resolve())
        for key in (job.id, "alices-job"):
            for path in (f"/v1/jobs/{key}", f"/v1/jobs/{key}/losses", f"/v1/jobs/{key}/transitions",
                         f"/v1/jobs/{key}/adapter"):
                answer = get(path, bob)
                assert answer.status_code == 404 and answer.json()["detail"] == f"no job with id or name '{key}'", path
            for verb in ("cancel", "pause", "resume"):
                answer = raw.post(f"/v1/jobs/{key}/{verb}", headers={"Authorization": f"Bearer {bob}"})
                assert answer.status_code == 404 and answer.json()["detail"] == f"no job with id or name '{key}'"
        assert job.id not in [r.id for r in as_bob.jobs()]
        assert job.id in [r.id for r in as_alice.jobs()] and as_root.status(job.id).user == "alice"
        later = as_bob.events(timeout=60)
        assert job.id not in [r["id"] for r in next(later).data["jobs"]]
        later.close()
        with pytest.raises(Conflict) as taken:
            as_bob.submit(job_dict("alices-job", data, 2), base_model=NOBODYS_MODEL)
        assert "held by another user's unfinished job" in str(taken.value) and job.id not in str(taken.value)
        assert "cancel it" not in str(taken.value), str(taken.value)   # bob cannot cancel alice's job
        assert as_alice.cancel(job.id).state == "cancelled"
        mine = as_bob.submit(job_dict("bobs-job", data, 2), base_model=NOBODYS_MODEL)
        seen = []
        for event in bobs_stream:   # bob's stream, open since before alice's job: bob's job only
            if event.kind == "transition":
                seen.append(event.data["job"])
                if event.data["job"] == mine.id:
                    break
        bobs_stream.close()
        assert seen == [mine.id]
        assert as_bob.cancel(mine.id).state == "cancelled"

        rotated = users.rotate("alice")            # refused from the next request on, the new one admitted
        assert get("/v1/jobs", alice).status_code == 401 and get("/v1/jobs", rotated).status_code == 200
        users.remove("bob")
        assert get("/v1/jobs", bob).status_code == 401
        assert get("/v1/audit", rotated).status_code == 403
        rows = get("/v1/audit", root).json()
        assert [(r["user"], r["action"], r["target"]) for r in rows] == [
            ("alice", "job.submit", job.id), ("alice", "job.cancel", job.id), ("bob", "job.submit", mine.id),
            ("bob", "job.cancel", mine.id)]
        assert rows == audit.rows() and all(r["time"] > 0 for r in rows)
        accounts = {row["user"]: row for row in as_root.accounts()}   # their jobs never trained: no usage yet
        assert accounts["alice"] == {"user": "alice", "jobs": 1, "tokens": 0, "step_seconds": 0.0, "gpu_seconds": 0.0}
        assert [row["user"] for row in HttpClient(url, rotated).accounts()] == ["alice"]   # a user: their own


def test_a_users_job_reads_only_under_its_data_roots(api, users, tmp_path):
    """A user's job whose data lies outside the service's and the user's data roots is refused at submit,
    naming the roots, and nothing is entered: a plain path, `../` out of a root, a symlink out of a root (the
    data itself, or a file inside a data folder), a URI prefix not listed, the service's state folder and
    another user's outputs; a file outside that does not exist is refused as outside (its existence is not
    revealed); a sweep whose job reads outside is refused when it is posted; the same data inside the root is
    taken. Refusals change nothing in the table."""
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    good = write_task_data(inside, "good")
    secret = write_task_data(outside, "secret")
    (inside / "link.jsonl").symlink_to(secret)
    folder = inside / "folder"
    folder.mkdir()
    (folder / "train.jsonl").symlink_to(secret)                 # a data folder with a file that links out
    state_data = write_task_data(api.state_dir / "stolen", "state")
    others = write_task_data(api.state_dir / "outputs" / "root" / "x", "others")
    alice, _ = users.add("alice", data_roots=[str(inside), "s3://team-a/data"])
    users.add("root", admin=True)
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    cases = [(secret, "is outside the data roots"), (inside / ".." / "outside" / "secret.jsonl", "is outside"),
             (inside / "link.jsonl", "is outside"), (outside / "missing.jsonl", "is outside"), (folder, "links out"),
             ("s3://team-a/database/x.jsonl", "is outside"), ("s3://team-a/data/../other/x.jsonl", "'..'"),
             (state_data, "the service's state folder"), (others, "the service's outputs other than yours")]
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        before = api.table()
        for data, phrase in cases:
            with pytest.raises(SpecRefused) as refused:
                as_alice.submit(job_dict("reader", data, 2), base_model=NOBODYS_MODEL)
            assert phrase in str(refused.value), (data, str(refused.value))
            if phrase.startswith("is outside") or phrase == "links out":
                assert str(inside) in str(refused.value) and "s3://team-a/data" in str(refused.value)
        assert api.table() == before
        sweep = {"name": "outside", "base_model": NOBODYS_MODEL, "output_dir": str(tmp_path / "sweep"),
                 "job": {**job_dict("reader", secret, 4), "eval_split": 4, "eval_every": 2}, "search": "grid",
                 "space": {"lr": {"choice": [1e-3, 1e-2]}}}
        answer = httpx.post(f"{url}/v1/sweeps", json=sweep, headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        assert answer.status_code == 422 and "is outside the data roots" in answer.json()["detail"], answer.text
        assert as_alice.sweeps() == [] and api.table() == before
        job = as_alice.submit(job_dict("reader", good, 2), base_model=NOBODYS_MODEL)
        assert api.ray.status(job.id).user == "alice"
        as_alice.cancel(job.id)


def test_a_second_users_job_starts_at_the_first_free_slot_ahead_of_anothers_twenty(ray_session, tiny_model_dirs,
                                                                                   tmp_path):
    """Fair share on a real service, through HTTP: on a trainer that runs one job at a time, alice submits 20
    jobs and, once hers train, bob submits one; the very next job the scheduler starts after his submission
    is his (his share of the trained tokens is none, hers all of them), not one of hers queued before his.
    The order is read from the job table's own transition log (through the Ray client). A relative output_dir
    on that service (users, no configured output root) lands under the user's outputs folder."""
    from tests.helpers.service import NO_LISTENERS, service_config

    state_dir = tmp_path / "state"
    book = UserBook.in_state_dir(state_dir)
    alice, _ = book.add("alice", data_roots=[str(tmp_path / "data")])
    bob, _ = book.add("bob", data_roots=[str(tmp_path / "data")])
    base = str(tiny_model_dirs["llama"])
    service = Client.local(service_config(state_dir, tiny_model_dirs["llama"], listeners=NO_LISTENERS, max_jobs=1),
                           name=f"aspen-fair-{uuid.uuid4().hex[:6]}")
    try:
        app = create_app(ServiceLink(client=service), "unused-single-token", events_poll_s=0.1, users=book)
        with running_server(app) as url:
            as_alice, as_bob = HttpClient(url, alice), HttpClient(url, bob)
            data = write_task_data(tmp_path / "data", "fair")
            hers = as_alice.submit_many([job_dict(f"a{i:02d}", data, 3) for i in range(20)], base_model=base)
            wait_for(lambda: any(r.step >= 1 for r in as_alice.jobs()), timeout=120, what="alice's jobs to train")
            [his] = as_bob.submit_many([job_dict("b00", data, 2)], base_model=base)
            assert his.wait(timeout=180).state == "completed"
            _, rows = service.transitions_after(0, 10000)
            submitted = next(row["seq"] for row in rows if row["job"] == his.id)
            started = [row["job"] for row in rows if row["state"] == "running" and row["seq"] < submitted]
            first_after = next(row["job"] for row in rows if row["state"] == "running" and row["seq"] > submitted
                               and row["job"] not in started)
            assert first_after == his.id, [(r["job"], r["state"]) for r in rows if r["seq"] > submitted][:6]
            assert len({h.id for h in hers} - set(started)) >= 15, started   # most of hers still queued then
            for handle in hers:
                if service.status(handle.id).state in ("queued", "running"):
                    service.cancel(handle.id)

            # the same service has no configured output root: a user's jobs write under <state>/outputs/<user>,
            # and a jobs file's relative output_dir lands there too, through the client as in a raw body (the
            # service named no root before: the client resolved it beside the file, which was then refused)
            outputs = (state_dir / "outputs").resolve()
            assert service.info()["output_root"] == str(outputs)
            jobs_file = tmp_path / "project" / "jobs.yaml"
            jobs_file.parent.mkdir()
            jobs_file.write_text(json.dumps({"base_model": base, "output_dir": "runs/mine",   # JSON is YAML
                                             "jobs": [job_dict("rel", data, 2)]}))
            (handle,) = as_alice.submit_run(jobs_file)
            assert service.status(handle.id).output_dir == str(outputs / "alice" / "runs" / "mine" / "rel")
            service.cancel(handle.id)
            raw = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {bob}"}, timeout=60,
                             json={"base_model": base, "output_dir": "runs/his", "jobs": [job_dict("rel", data, 2)]})
            assert raw.status_code == 201, raw.text
            assert raw.json()["jobs"][0]["output_dir"] == str(outputs / "bob" / "runs" / "his" / "rel")
            service.cancel(raw.json()["jobs"][0]["id"])
    finally:
        service.shutdown()


def test_a_server_over_a_running_service_reads_the_services_own_users(api, users, tmp_path):
    """`aspen http --address ADDR` without --state-dir, as the README starts it, beside a service whose users were
    added with `aspen user add --state-dir <its folder>`: the server asks the service where its state lives
    (`ServiceStateFolder`, what `serve` builds), so alice's token opens the API and every action is audited there;
    the single token, no longer in force, is refused with a 401 that says a users file is in force and where."""
    from orchestrator.http.callers import ServiceStateFolder
    from orchestrator.service_calls import call_service

    folder = ServiceStateFolder(lambda: call_service(api.link, lambda client: client.info()), fallback=tmp_path)
    app = create_app(api.link, api.token, users=folder.users(), audit=folder.audit())
    alice, _ = users.add("alice")
    with running_server(app) as url:
        mine = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        assert mine.status_code == 200, mine.text
        single = httpx.get(f"{url}/v1/jobs", headers=api.auth(), timeout=60)
        assert single.status_code == 401
        assert "a users file is in force" in single.json()["detail"] and str(users.path) in single.json()["detail"]
    assert folder.path() == Path(api.state_dir).resolve()


def test_the_service_description_names_only_the_callers_own_jobs(api, users, tmp_path):
    """`GET /v1/service` (the console's trainers page) shows each trainer's jobs and their tokens in its last fused
    step: alice's job, running on the trainer, is there for alice and an admin, as the Ray client has it (the
    reference), and nowhere in bob's answer (neither its id nor its name), who still sees the trainer itself."""
    data = write_task_data(tmp_path / "data", "held")
    root, alice, bob = root_alice_bob(users, tmp_path / "data")
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        job = HttpClient(url, alice).submit(job_dict("alices-secret-job", data, 100_000), base_model=api.base)
        try:
            def stepping() -> dict | None:   # the reference: the trainer holds alice's job and booked its tokens
                trainers = api.ray.info()["trainers"]
                return next((t for t in trainers if job.id in t.get("last_step_job_tokens", {})), None)

            wait_for(stepping, timeout=120, what="alice's job in its trainer's last fused step")
            for token, sees in ((alice, True), (root, True), (bob, False)):
                answer = httpx.get(f"{url}/v1/service", headers={"Authorization": f"Bearer {token}"}, timeout=60)
                assert answer.status_code == 200, answer.text
                trainer = next(t for t in answer.json()["trainers"] if t["base_model"] == api.base)
                assert (job.id in trainer["jobs"]) is sees and (job.id in trainer["last_step_job_tokens"]) is sees
                if not sees:
                    assert "alices-secret-job" not in answer.text and job.id not in answer.text, answer.text
                    assert trainer["ready"] and trainer["steps"] > 0   # the trainer itself is still described
        finally:
            api.ray.cancel(job.id)


def test_a_job_that_failed_before_training_has_no_generations_not_a_folder_elsewhere(api, users, tmp_path):
    """A job that started and failed before its first step (its data file gone by then) wrote no folder: its
    generations (the console's job page asks for them) are an empty answer, as for a job not started, not a 503
    saying its folder is on another node (this service has one). alice's quota of one running job holds the
    second job queued until its data is gone, then the first is cancelled and the second starts and fails; the
    Ray client's record (the reference) says it failed at step 0, and no folder of it exists."""
    data = write_task_data(tmp_path / "data", "first")
    doomed = write_task_data(tmp_path / "data", "doomed")
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")], quotas={"running": 1})
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        first = as_alice.submit(job_dict("first", data, 100_000), base_model=api.base)
        wait_for(lambda: api.ray.status(first.id).state == "running", timeout=120, what="the first job to run")
        second = as_alice.submit(job_dict("doomed", doomed, 5), base_model=api.base)
        wait_for(lambda: "quota" in api.ray.status(second.id).reason, timeout=60, what="the quota to hold it",
                 state=lambda: api.ray.status(second.id))
        doomed.unlink()
        as_alice.cancel(first.id)
        record = wait_for(lambda: (r := api.ray.status(second.id)).state in ("failed", "completed") and r,
                          timeout=120, what="the second job to end")
        assert record.state == "failed" and record.started_at is not None and record.step == 0, record
        assert "could not be read" in record.reason and not Path(record.output_dir).exists()
        answer = httpx.get(f"{url}/v1/jobs/{second.id}/generations", headers={"Authorization": f"Bearer {alice}"},
                           timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["steps"] == [] and answer.json()["rows"] == []


def test_resuming_or_extending_a_users_job_keeps_their_queued_quota_and_data_roots(api, users, tmp_path):
    """Queuing a job again (resume, extend) is held to what its user may queue and read now, as a submission is:
    alice (quota queued=1) cancels a job, submits another (queued: her one), and may neither resume nor extend the
    first (429 with Retry-After naming the quota, as at submit; it stays cancelled, as the Ray client, the reference,
    has it); with
    the other gone, the operator narrows her data roots to a folder without the job's data, and resuming is refused
    naming the roots; with her roots given back, it is queued again."""
    data = write_task_data(tmp_path / "data", "again")
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")], quotas={"queued": 1})
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        first = as_alice.submit(job_dict("first", data, 5), base_model=NOBODYS_MODEL)   # queued, never trains
        assert as_alice.cancel(first.id).state == "cancelled"
        other = as_alice.submit(job_dict("other", data, 5), base_model=NOBODYS_MODEL)
        for requeue in (lambda: as_alice.resume(first.id), lambda: as_alice.raise_max_steps(first.id, 10)):
            with pytest.raises(QuotaExceeded) as refused:
                requeue()
            assert refused.value.status == 429 and refused.value.retry_after == 30, refused.value.retry_after
            assert "user alice: quota queued=1" in str(refused.value), str(refused.value)
            assert api.ray.status(first.id).state == "cancelled"
        assert [r.id for r in api.ray.jobs(["queued"]) if r.user == "alice"] == [other.id]
        as_alice.cancel(other.id)
        users.update("alice", data_roots=[str(tmp_path / "elsewhere")])
        with pytest.raises(SpecRefused) as outside:
            as_alice.resume(first.id)
        assert "outside the data roots" in str(outside.value) and api.ray.status(first.id).state == "cancelled"
        users.update("alice", data_roots=[str(tmp_path / "data")])
        assert as_alice.resume(first.id).state == "queued" and api.ray.status(first.id).state == "queued"
        as_alice.cancel(first.id)


def _entered(api) -> tuple:
    """Every job's id and state and the newest transition's number: what a refused request must leave as it was (a
    queued job's reason, which the scheduler words between two reads, aside)."""
    rows, transition = api.table()
    return [(row["id"], row["state"]) for row in rows], transition


def _settled(api) -> tuple:
    """`_entered` once no job runs: an earlier test's job it cancelled while running ends `cancelled` when its trainer
    lets it go, a transition that came between the two reads of a test (seen in CI)."""
    wait_for(lambda: all(state != "running" for _, state in _entered(api)[0]), 120, "earlier tests' jobs to settle")
    return _entered(api)


def test_a_quota_refusal_is_a_429_with_retry_after_not_a_spec_refusal(api, users, tmp_path):
    """Past her queued quota (2), alice's third job is refused 429 with Retry-After (a wait, not a wrong spec): the
    body's detail names her, the quota, its value and what frees it; HttpClient raises QuotaExceeded (not a
    SpecRefused) with the hint; `aspen submit --url` says it in one line and exits 4; nothing is entered (the Ray
    client's table, the reference). A wrong spec from her still answers 422. A daily-token quota of 0 is refused 429
    without Retry-After (no wait frees it): the detail says her quota is 0 and to ask an admin, and so does the CLI's
    line, with no "try again in"."""
    data = write_task_data(tmp_path / "data", "quota")
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")], quotas={"queued": 2})
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        held = [as_alice.submit(job_dict(f"q{i}", data, 5), base_model=NOBODYS_MODEL) for i in range(2)]
        before = _settled(api)
        raw = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {alice}"}, timeout=60,
                         json={**job_dict("q2", data, 5), "base_model": NOBODYS_MODEL})
        assert raw.status_code == 429, raw.text
        assert raw.headers["Retry-After"] == "30"
        detail = raw.json()["detail"]
        assert detail.startswith("user alice: quota queued=2: 2 of their jobs are queued and this adds 1; wait for "
                                 "some to start or end"), detail
        with pytest.raises(QuotaExceeded) as refused:
            as_alice.submit(job_dict("q2", data, 5), base_model=NOBODYS_MODEL)
        assert not isinstance(refused.value, SpecRefused) and refused.value.retry_after == 30
        assert detail in str(refused.value)
        with pytest.raises(SpecRefused):   # a wrong spec is still the spec's 422, quota or not
            as_alice.submit({**job_dict("q3", data, 5), "lr": -1}, base_model=NOBODYS_MODEL)
        jobs_file = tmp_path / "jobs.yaml"
        jobs_file.write_text(json.dumps({"base_model": NOBODYS_MODEL, "jobs": [job_dict("q2", data, 5)]}))
        cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--url", url],
                             env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": alice},
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 4, (cli.returncode, cli.stderr)
        assert cli.stderr.strip().splitlines() == [f"aspen: over your quota: {detail} (HTTP 429); try again in 30 s"]
        assert _entered(api) == before

        for handle in held:
            as_alice.cancel(handle.id)
        users.update("alice", quotas={"queued": None, "tokens_per_day": 0})
        zero = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {alice}"}, timeout=60,
                          json={**job_dict("q4", data, 5), "base_model": NOBODYS_MODEL})
        # a quota of 0 admits nothing, ever: no wait to suggest, an admin to ask
        assert zero.status_code == 429 and "Retry-After" not in zero.headers, zero.headers
        assert zero.json()["detail"] == ("user alice: quota tokens_per_day=0: no job of theirs is admitted, now or "
                                         "later (waiting frees nothing); ask an admin of the service to raise it "
                                         "(`aspen user set alice --quota tokens_per_day=N`)")
        cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--url", url],
                             env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": alice},
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 4, (cli.returncode, cli.stderr)
        assert cli.stderr.strip().splitlines() == [f"aspen: over your quota: {zero.json()['detail']} (HTTP 429)"]
        assert "q4" not in [r.name for r in api.ray.jobs()]


def test_a_quota_set_on_a_running_service_holds_from_the_next_submission(api, users, tmp_path):
    """docs/users.md: user changes take effect from the next request. alice, without quotas, has a job running on
    the service's trainer (which runs several at once); the operator gives her `running=1` and she submits a
    second job at once: it is held queued, cause `quota`, and never starts while the first runs, as the Ray
    client's record (the reference) has it; her queued quota, set at once too, refuses a third (429)."""
    data = write_task_data(tmp_path / "data", "now")
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")])
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        first = as_alice.submit(job_dict("first", data, 100_000), base_model=api.base)
        try:
            wait_for(lambda: api.ray.status(first.id).state == "running", timeout=120, what="the first job to run")
            users.update("alice", quotas={"running": 1, "queued": 1})
            second = as_alice.submit(job_dict("second", data, 100_000), base_model=api.base)
            held = wait_for(lambda: (r := api.ray.status(second.id)).reason != "submitted" and r, timeout=30,
                            what="a decision round on the second job", state=lambda: api.ray.status(second.id))
            assert "quota" in held.reason and held.started_at is None, held
            time.sleep(1.0)   # several decision rounds later, still held
            record = api.ray.status(second.id)
            assert record.state == "queued" and record.started_at is None and "quota" in record.reason, record
            with pytest.raises(QuotaExceeded):
                as_alice.submit(job_dict("third", data, 5), base_model=api.base)
        finally:
            for job in api.ray.jobs(["queued", "running"]):
                if job.user == "alice":
                    api.ray.cancel(job.id)


def test_a_sweep_over_its_users_quota_is_a_429_as_her_job_is(api, users, tmp_path):
    """alice's one queued place is taken: her sweep, whose first trial her quota refuses, was taken (201) and each
    trial failed on the quota. It is refused as her job is (the same job alone, the reference): 429 with the same
    Retry-After and the quota's words, HttpClient raises QuotaExceeded, `aspen sweep FILE --url` says it in one line
    and exits 4; nothing is entered and no sweep made (the Ray client's view). (A later trial over her quota waits:
    tests/unit/service/test_sweep_quotas.py.)"""
    data = write_task_data(tmp_path / "data", "sq")
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")], quotas={"queued": 1})
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    sweep = {"name": "over-quota", "base_model": NOBODYS_MODEL, "step_tokens": 512, "search": "grid",
             "output_dir": str(api.state_dir / "outputs" / "alice" / "over-quota"),
             "job": job_dict("sq", data, 4, eval_split=4, eval_every=2), "space": {"lr": {"choice": [1e-3, 1e-2]}}}
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        held = as_alice.submit(job_dict("sq-held", data, 5), base_model=NOBODYS_MODEL)   # queued for good
        before = _settled(api)
        auth = {"Authorization": f"Bearer {alice}"}
        as_job = httpx.post(f"{url}/v1/jobs", headers=auth, timeout=60,
                            json={**job_dict("sq-t0", data, 4), "base_model": NOBODYS_MODEL})
        raw = httpx.post(f"{url}/v1/sweeps", headers=auth, json=sweep, timeout=60)
        assert as_job.status_code == raw.status_code == 429, raw.text
        assert raw.headers["Retry-After"] == as_job.headers["Retry-After"] == "30"
        detail = raw.json()["detail"]
        assert detail == ("nothing was started: the sweep's first trial 'sq-t0' is over its user's quota: "
                          + as_job.json()["detail"]), (detail, as_job.json())
        with pytest.raises(QuotaExceeded) as refused:
            as_alice.sweep(sweep)
        assert refused.value.retry_after == 30 and detail in str(refused.value)
        (tmp_path / "sweep.yaml").write_text(json.dumps(sweep))
        cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", str(tmp_path / "sweep.yaml"),
                              "--url", url], env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": alice},
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 4, (cli.returncode, cli.stderr)
        assert cli.stderr.strip().splitlines() == [f"aspen: over your quota: {detail} (HTTP 429); try again in 30 s"]
        assert _entered(api) == before and "over-quota" not in {s["name"] for s in api.ray.sweeps()}
        as_alice.cancel(held.id)
