"""The users file (actors/service/accounts/users.py) and the audit log (actors/service/accounts/audit.py),
through the files
themselves and from several processes at once: tokens are kept only as hashes; a change made by another
process (another `aspen user` command) is seen at once; two processes adding users at once lose nothing;
the service's single token becomes the first admin's; a damaged or world-readable file, a bad name, a
duplicate and removing the last admin are refused with the fix; concurrent audit lines stay whole."""

from __future__ import annotations

import getpass
import json
import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook, UserError, UsersFileError

REPO = Path(__file__).resolve().parents[3]


def test_tokens_are_kept_only_as_hashes_and_changes_are_seen_at_once(tmp_path):
    book = UserBook.in_state_dir(tmp_path)
    alice, _ = book.add("alice")
    bob, _ = book.add("bob", share=2)
    text = book.path.read_text()
    assert alice not in text and bob not in text                         # hashes only
    assert stat.S_IMODE(book.path.stat().st_mode) == 0o600
    assert book.authenticate(alice).name == "alice" and book.authenticate(bob).share == 2.0
    assert book.authenticate("not-a-token") is None

    other = UserBook.in_state_dir(tmp_path)     # the HTTP server's view, kept while commands change the file
    assert other.authenticate(alice).name == "alice"
    new = book.rotate("alice")
    assert other.authenticate(alice) is None and other.authenticate(new).name == "alice"
    book.remove("bob")
    assert other.authenticate(bob) is None and [u.name for u in other.users()] == ["alice"]


def _add_many(state_dir: str, prefix: str, count: int) -> None:
    book = UserBook.in_state_dir(state_dir)
    for index in range(count):
        book.add(f"{prefix}{index}")


def in_processes(target, arguments: list[tuple]) -> None:
    """`target(*args)` for each of `arguments` in processes of their own, all at once; each must succeed."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=target, args=args) for args in arguments]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0


def test_two_processes_adding_at_once_lose_nothing(tmp_path):
    in_processes(_add_many, [(str(tmp_path), prefix, 15) for prefix in ("a", "b")])
    names = [user.name for user in UserBook.in_state_dir(tmp_path).users()]
    assert sorted(names) == sorted([f"a{i}" for i in range(15)] + [f"b{i}" for i in range(15)])


def test_the_single_token_becomes_the_first_admins_and_mistakes_are_refused(tmp_path):
    book = UserBook.in_state_dir(tmp_path)
    single = "the-services-single-token-0123456789"
    token, notes = book.add("root", admin=True, adopt_token=single)
    assert token is None and "now root's" in notes[0] and book.authenticate(single).admin
    second, notes = book.add("ops", admin=True, adopt_token=single)   # only the first admin takes it
    assert second and not notes and book.authenticate(second).name == "ops"
    with pytest.raises(UserError, match="user 'ops' exists"):
        book.add("ops")
    with pytest.raises(UserError, match="user name 'Ops'"):
        book.add("Ops")
    with pytest.raises(UserError, match="share 0"):
        book.add("zero", share=0)
    with pytest.raises(UserError, match="no user named 'nobody'"):
        book.rotate("nobody")
    book.add("user1")
    book.remove("ops")
    with pytest.raises(UserError, match="'root' is the last admin"):
        book.remove("root")


def test_a_damaged_or_readable_file_is_refused_with_the_fix(tmp_path):
    book = UserBook.in_state_dir(tmp_path)
    book.add("alice")
    os.chmod(book.path, 0o644)
    with pytest.raises(UsersFileError, match="chmod 600"):
        UserBook.in_state_dir(tmp_path).users()
    os.chmod(book.path, 0o600)
    book.path.write_text('{"format": 1, "users": [{"name": "x"}]}')
    with pytest.raises(UsersFileError, match="cannot be read .*restore it from a backup"):
        UserBook.in_state_dir(tmp_path).users()


def test_the_cli_prints_a_token_once_and_never_again(tmp_path):
    def user(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "user", *args, "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, cwd=REPO, env={**os.environ, "ASPEN_TOKEN_FILE":
                                                                            str(tmp_path / "no-token")})
    added = user("add", "alice", "--json")
    assert added.returncode == 0, added.stderr
    assert f"the users file is {tmp_path / 'users.json'}: a service whose state folder" in added.stderr   # which
    token = json.loads(added.stdout)["token"]
    assert UserBook.in_state_dir(tmp_path).authenticate(token).name == "alice"
    shown = user("token", "alice")
    assert shown.returncode == 2 and "--rotate" in shown.stderr and token not in shown.stdout + shown.stderr
    rotated = user("token", "alice", "--rotate", "--json")
    assert rotated.returncode == 0 and UserBook.in_state_dir(tmp_path).authenticate(token) is None
    listed = user("list", "--json")
    assert json.loads(listed.stdout)[0]["name"] == "alice" and "sha256" not in listed.stdout
    rows = AuditLog.in_state_dir(tmp_path).rows()   # the changes audited, as the account that ran the command
    assert [(row["action"], row["target"]) for row in rows] == [("user.add", "alice"), ("user.token", "alice")]
    assert {row["user"] for row in rows} == {f"os:{getpass.getuser()}"}


def _write_audit(path: str, who: str, count: int) -> None:
    log = AuditLog(path)
    for index in range(count):
        log.record(who, "job.submit", f"{who}-{index}", padding="x" * 3000)


def test_concurrent_audit_lines_stay_whole(tmp_path):
    path = tmp_path / "audit.jsonl"
    in_processes(_write_audit, [(str(path), who, 200) for who in ("alice", "bob")])
    rows = AuditLog(path).rows()
    assert len(rows) == 400 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [r["target"] for r in rows if r["user"] == "alice"] == [f"alice-{i}" for i in range(200)]
    assert len(AuditLog(path).rows(user="bob")) == 200
    assert AuditLog(path).rows(after=rows[-1]["time"]) == []


def test_data_roots_follow_links_and_folders_and_compare_uris_by_component(tmp_path):
    from actors.service.scheduler.data_roots import as_root, data_problem

    inside, outside = tmp_path / "inside", tmp_path / "outside"
    (inside / "folder" / "nested").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jsonl").write_text("{}\n")
    (inside / "folder" / "a.jsonl").write_text("{}\n")
    roots = [as_root(inside), as_root("s3://team/data/")]
    assert data_problem(inside / "folder", roots) is None
    (inside / "folder" / "nested" / "b.jsonl").symlink_to(outside / "secret.jsonl")   # deep inside, links out
    assert "links out" in data_problem(inside / "folder", roots)
    assert "is outside" in data_problem(inside / ".." / "outside" / "secret.jsonl", roots)
    assert data_problem("s3://team/data/x.jsonl", roots) is None
    assert "is outside" in data_problem("s3://team/database/x.jsonl", roots)
    assert "'..'" in data_problem("s3://team/data/../x.jsonl", roots)
    assert "is outside" in data_problem(inside / "folder" / "a.jsonl", [])   # no roots: nothing may be read
    forbidden = [(as_root(inside), "the state folder", as_root(inside / "folder"))]
    assert data_problem(inside / "folder" / "a.jsonl", None, forbidden) is None          # the allowed part
    (inside / "other.jsonl").write_text("{}\n")
    assert "lies in the state folder" in data_problem(inside / "other.jsonl", None, forbidden)


def test_the_scheduler_serves_the_least_served_user_and_refuses_past_quotas(tmp_path):
    """A real job table and users file: a, with 20 jobs queued first and tokens trained, and b, with one job
    submitted after them: when the one slot frees, b's job starts in that round. Quotas: b's queued quota
    refuses a batch that would pass it (naming the quota, nothing entered); an unknown user is refused."""
    from dataclasses import replace

    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.scheduler.submissions import SubmissionError
    from actors.service.table.job_table import JobTable
    from actors.spec.job_submission import JobSubmission
    from policies.base import Start
    from policies.registry import load_policy
    from tests.helpers.service import job_dict, write_task_data
    from tests.helpers.trainer import fake_status

    state = tmp_path / "state"
    data = write_task_data(tmp_path / "data", "q")
    book = UserBook.in_state_dir(state)
    book.add("a", data_roots=[str(tmp_path / "data")])
    book.add("b", data_roots=[str(tmp_path / "data")], quotas={"queued": 2})
    table = JobTable(state / "jobs.sqlite")
    core = SchedulerCore(table, load_policy("adaptive"), state)

    def submit(name: str, user: str) -> str:
        return core.submit(JobSubmission(job=job_dict(name, data, 5), user=user)).id

    first = submit("a-0", "a")
    table.progress.add(first, {"step": 1, "loss": 2.0, "tokens": 5000})   # a has trained already
    a_jobs = [first] + [submit(f"a-{i}", "a") for i in range(1, 20)]
    b_job = submit("b-0", "b")
    one_slot = replace(fake_status("trainer-0", "smollm2-135m"), max_jobs=1)
    started = [action for action in core.plan([one_slot]) if isinstance(action, Start)]
    assert started == [Start(b_job, "trainer-0")]
    assert table.get(b_job).user == "b" and all(table.get(j).state == "queued" for j in a_jobs)
    before = len(table.all())
    submissions = [JobSubmission(job=job_dict(f"b-{i}", data, 5), user="b") for i in (1, 2)]
    with pytest.raises(SubmissionError, match="user b: quota queued=2: 0 of their jobs are queued and this adds 3"):
        core.submissions.submit_many(submissions + [JobSubmission(job=job_dict("b-3", data, 5), user="b")])
    assert len(table.all()) == before
    with pytest.raises(SubmissionError, match="'c' is not a user of this service"):
        core.submit(JobSubmission(job=job_dict("c-0", data, 5), user="c"))
    table.close()


def test_the_accounts_add_up_to_the_trainers_step_log(tmp_path, tiny_base, tiny_model_dirs):
    """Two users' jobs fused on one trainer: each user is accounted their jobs' real tokens and their shares of
    each step's seconds by those tokens; summed, they are the step log's (the reference: what the trainer
    wrote), per job and in total; on a CPU no GPU-seconds."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.table.job_table import JobTable
    from actors.service.trainer.trainer_loop import TrainerLoop
    from actors.spec.job_submission import JobSubmission
    from policies.fifo import FifoPolicy
    from tests.helpers.service import job_dict, write_task_data
    from tests.helpers.trainer import assignment_for, run_until_idle

    state = tmp_path / "state"
    data = tmp_path / "data"
    book = UserBook.in_state_dir(state)
    for user in ("alice", "bob"):
        book.add(user, data_roots=[str(data)])
    table = JobTable(state / "jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), state)
    submissions = [JobSubmission(job=job_dict(f"{user}-job", write_task_data(data, user, offset=i), 4 + 2 * i),
                                 base_model=str(tiny_model_dirs["llama"]), user=user,
                                 output_dir=str(state / "outputs" / user / "job"))
                   for i, user in enumerate(("alice", "bob"))]
    records = [core.submit(submission) for submission in submissions]
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=str(tiny_model_dirs["llama"]), step_tokens=1024),
                       "trainer-t", state)
    for record, submission in zip(records, submissions, strict=True):
        loop.assign(assignment_for(submission, record.id, tiny_base.tokenizer))
    events = run_until_idle(loop)
    with table.transaction():
        for event in events:
            core.booking.apply_event("trainer-t", event)
    rows = [json.loads(line) for line in (state / "trainers" / "trainer-t.jsonl").read_text().splitlines()]
    assert any(len(row["job_tokens"]) == 2 for row in rows)            # the two users' jobs shared steps
    accounts = table.usage.accounts()
    for record in records:
        logged = sum(row["job_tokens"].get(record.id, 0) for row in rows)
        assert accounts[record.user]["tokens"] == logged > 0
    assert sum(a["step_seconds"] for a in accounts.values()) == pytest.approx(sum(r["seconds"] for r in rows),
                                                                             rel=1e-9)
    assert all(a["gpu_seconds"] == 0 and a["jobs"] == 1 for a in accounts.values())
    table.close()


def test_adding_the_first_user_never_locks_the_operator_out(tmp_path):
    """The README's order (`aspen http` with its single token, then `aspen user add alice`): the single token
    stays valid as the admin 'operator' (said on stderr, audited); the HTTP gate admits it as an admin and
    alice as herself; `aspen http-token` prints it and says whose it is; once operator is removed (another
    admin added first), `aspen http-token` refuses to print a token that no longer opens the API (exit 1)."""
    from orchestrator.http.callers import Gate
    from orchestrator.http.token import ensure_token

    token_path = tmp_path / "http-token"
    single = ensure_token(str(token_path))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "ASPEN_TOKEN_FILE": str(token_path)})

    added = cli("user", "add", "alice", "--json", "--state-dir", str(tmp_path), "--token-file", str(token_path))
    assert added.returncode == 0, added.stderr
    assert "stays valid as the admin 'operator'" in added.stderr and "users file is in force" in added.stderr
    alice = json.loads(added.stdout)["token"]
    book = UserBook.in_state_dir(tmp_path)
    gate = Gate(single, book)
    operator, caller = gate.caller(single), gate.caller(alice)
    assert (operator.name, operator.admin) == ("operator", True) and (caller.name, caller.admin) == ("alice", False)
    assert [(row["action"], row["target"]) for row in AuditLog.in_state_dir(tmp_path).rows()] == [
        ("user.add", "operator"), ("user.add", "alice")]
    shown = cli("http-token", "--state-dir", str(tmp_path), "--token-file", str(token_path))
    assert shown.returncode == 0 and shown.stdout.strip() == single and "the admin 'operator'" in shown.stderr
    assert cli("user", "add", "root", "--admin", "--state-dir", str(tmp_path)).returncode == 0
    assert cli("user", "remove", "operator", "--state-dir", str(tmp_path)).returncode == 0
    refused = cli("http-token", "--state-dir", str(tmp_path), "--token-file", str(token_path))
    assert refused.returncode == 1 and single not in refused.stdout
    assert "users file is in force" in refused.stderr and "not one of them" in refused.stderr
    assert gate.caller(single) is None


def test_a_first_admin_takes_the_single_token_and_no_operator_is_made(tmp_path):
    book = UserBook.in_state_dir(tmp_path)
    single = "the-services-single-token-0123456789"
    token, _ = book.add("root", admin=True, adopt_token=single)
    assert token is None and [user.name for user in book.users()] == ["root"]
    other = UserBook.in_state_dir(tmp_path / "other")
    other.add("alice", adopt_token=None)   # no single token to keep: nobody is added beside alice
    assert [user.name for user in other.users()] == ["alice"]


def test_user_set_changes_roots_share_and_quotas_keeping_the_token_and_the_scheduler_follows(tmp_path):
    """`aspen user set` as an operator runs it: alice's data root moved and a queued quota given, her token
    unchanged; the scheduler (a real job table, the same users file) then refuses her job on the old folder and
    past the quota, and takes it on the new one; a limit removed with KEY=none; the last admin kept; each change
    audited; `user add` of an existing user points to `user set`."""
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.scheduler.submissions import SubmissionError
    from actors.service.table.job_table import JobTable
    from actors.spec.job_submission import JobSubmission
    from policies.registry import load_policy
    from tests.helpers.service import job_dict, write_task_data

    state = tmp_path / "state"

    def user(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "user", *args, "--state-dir", str(state)],
                              capture_output=True, text=True, cwd=REPO, env={**os.environ, "ASPEN_TOKEN_FILE":
                                                                            str(tmp_path / "no-token")})

    old_data = write_task_data(tmp_path / "old", "q")
    new_data = write_task_data(tmp_path / "new", "q")
    assert user("add", "root", "--admin").returncode == 0
    added = user("add", "alice", "--data-root", str(tmp_path / "old"), "--json")
    token = json.loads(added.stdout)["token"]
    again = user("add", "alice", "--data-root", str(tmp_path / "new"))
    assert again.returncode == 2 and "aspen user set alice" in again.stderr
    changed = user("set", "alice", "--data-root", str(tmp_path / "new"), "--share", "2", "--quota", "queued=1",
                   "--json")
    assert changed.returncode == 0, changed.stderr
    shown = json.loads(changed.stdout)
    assert shown["data_roots"] == [str(tmp_path / "new")] and shown["share"] == 2 and shown["quotas"] == {"queued": 1}
    assert UserBook.in_state_dir(state).authenticate(token).name == "alice"   # the same token opens the API

    core = SchedulerCore(JobTable(state / "jobs.sqlite"), load_policy("adaptive"), state)
    with pytest.raises(SubmissionError, match="is outside"):
        core.submit(JobSubmission(job=job_dict("on-old", old_data, 5), user="alice"))
    core.submit(JobSubmission(job=job_dict("on-new", new_data, 5), user="alice"))
    with pytest.raises(SubmissionError, match="quota queued=1"):
        core.submit(JobSubmission(job=job_dict("second", new_data, 5), user="alice"))
    assert user("set", "alice", "--quota", "queued=none").returncode == 0
    core.submit(JobSubmission(job=job_dict("second", new_data, 5), user="alice"))
    assert [r.name for r in core.table.all()] == ["on-new", "second"]
    core.table.close()

    last = user("set", "root", "--no-admin")
    assert last.returncode == 2 and "last admin" in last.stderr
    assert user("set", "alice").returncode == 2 and user("set", "nobody", "--share", "1").returncode == 2
    rows = [row for row in AuditLog.in_state_dir(state).rows() if row["action"] == "user.set"]
    assert [(row["target"], row.get("quotas")) for row in rows] == [("alice", {"queued": 1}),
                                                                     ("alice", {"queued": None})]


def test_a_users_job_calls_only_the_functions_the_operator_allows(tmp_path):
    """A reward or generation metric is code the trainers run on texts the job's user controls (`builtins:exec`
    as a metric would run whatever the adapter writes): a user's job may name a built-in one, or a function the
    service's `user_functions` allows (by name, or every function of a module with `module:*`), never a file; an
    admin's and an operator's (Ray client, no user) jobs may name any. Refused at submit, nothing entered."""
    from actors.service.scheduler.config import ServiceConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.scheduler.submissions import SubmissionError
    from actors.service.table.job_table import JobTable
    from actors.spec.job_submission import JobSubmission
    from policies.registry import load_policy
    from tests.helpers.service import job_dict, write_task_data

    state = tmp_path / "state"
    data = write_task_data(tmp_path / "data", "q")
    book = UserBook.in_state_dir(state)
    book.add("root", admin=True)
    book.add("alice", data_roots=[str(tmp_path / "data")])
    allowed = ServiceConfig(user_functions=["tests.helpers.metrics:*", "tests.helpers.rewards:shorter"]).user_functions
    table = JobTable(state / "jobs.sqlite")
    core = SchedulerCore(table, load_policy("fifo"), state, user_functions=allowed)

    def job(name: str, metric: str, reward: str | list[str] | None = None) -> dict:
        extra = {"method": "grpo", "grpo": {"reward": reward, "num_generations": 2, "max_new_tokens": 4}} \
            if reward else {}
        return job_dict(name, data, 2, eval_split=2, eval_generate={"metric": metric}, **extra)

    for name, metric, reward in (("ok-1", "contains", None), ("ok-2", "tests.helpers.metrics:recorded", "exact_match"),
                                 ("ok-3", "exact_match", "tests.helpers.rewards:shorter")):
        core.submit(JobSubmission(job=job(name, metric, reward), user="alice"))
    refused = [("builtins:exec", None, "eval_generate.metric 'builtins:exec'"),
               (f"{tmp_path / 'mine.py'}:f", None, "eval_generate.metric '"),
               ("contains", "tests.helpers.rewards:raises", "grpo.reward 'tests.helpers.rewards:raises'"),
               ("contains", ["tests.helpers.rewards:shorter", "tests.helpers.rewards:sevens"],
                "grpo.reward.1 'tests.helpers.rewards:sevens'")]   # one of several not allowed
    for metric, reward, named in refused:
        with pytest.raises(SubmissionError) as caught:
            core.submit(JobSubmission(job=job("no", metric, reward), user="alice"))
        assert named in str(caught.value) and "user_functions in its config: tests.helpers.metrics:*, " \
               "tests.helpers.rewards:shorter); ask an operator to allow it" in str(caught.value), caught.value
    assert sorted(r.name for r in table.all()) == ["ok-1", "ok-2", "ok-3"]
    core.submit(JobSubmission(job=job("admins", "builtins:exec"), user="root"))
    core.submit(JobSubmission(job=job("operators", "builtins:exec")))
    with pytest.raises(ValueError, match="user_functions"):
        ServiceConfig(user_functions=["mine.py:f"])
    table.close()
