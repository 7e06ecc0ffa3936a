"""A damaged job table, caused as it happens (the file overwritten, cut short, emptied, one page of it
garbled; its backup damaged too), met by every entry point that opens it: the service (`Client.local`, the
scheduler actor `aspen serve` also starts), `aspen run` on Ray, and the readers that open the file
themselves (`aspen report`, `aspen export --from`). Each says in one line which file is damaged, whether its
backup is sound, and the commands to restore it; running those very commands brings the backup's jobs back.

The backup is checked against the writer's own invariant: a writer in another process adds a progress row
and moves its job's `step` in one transaction, so a consistent copy has, for every job, as many rows as its
step, whichever moment it caught; SQLite's `PRAGMA integrity_check` checks the file itself."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.service.scheduler.config import ServiceConfig
from actors.service.table.job_table import JobTable, JobTableDamaged
from actors.service.table.table_backup import TableBackups, backup_path, take_backup
from actors.spec.job_submission import JobSubmission
from orchestrator.client import Client, ServiceError
from tests.helpers.service import NO_LISTENERS, job_dict, run_spec, wait_for, write_task_data
from tests.helpers.service import service_config as shared_service_config

NOBODYS_MODEL = "some-org/model-nobody-holds"   # no trainer holds it: its jobs stay queued, never train


def submission(name: str) -> JobSubmission:
    return JobSubmission.model_validate({"job": {"name": name, "data": "/data/x.jsonl", "max_steps": 3,
                                                 "format": {"type": "alpaca"}}, "base_model": NOBODYS_MODEL})


def fill_table(path: Path, jobs: int, steps: int, first: int = 0) -> list[str]:
    """`jobs` jobs with `steps` progress rows each; their ids."""
    table = JobTable(path)
    ids = []
    for number in range(first, first + jobs):
        record = table.add(f"job-{number}", submission(f"job-{number}"), Path(f"/out/job-{number}"))
        with table.transaction():
            for step in range(1, steps + 1):
                table.progress.add(record.id, {"step": step, "loss": 1.0 / step, "tokens": 100})
        ids.append(record.id)
    table.close()
    return ids


def garble(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "overwritten":
        path.write_bytes(os.urandom(size))
    elif how == "cut short":
        os.truncate(path, size // 2)
    elif how == "emptied":
        os.truncate(path, 0)
    elif how == "a page garbled":
        with path.open("r+b") as handle:
            handle.seek(size // 2)
            handle.write(os.urandom(4096))


def the_command(message: str) -> str:
    """The shell commands the one-line message gives (after "run: ", before the note in parentheses)."""
    assert "\n" not in message, message
    return message.split(" run: ", 1)[1].split("  (", 1)[0]


def job_ids(path: Path) -> set[str]:
    """The jobs of a table as the service opens it (with its checks)."""
    table = JobTable(path)
    try:
        return {record.id for record in table.all()}
    finally:
        table.close()


def read(path: Path, query: str) -> list[tuple]:
    """A query on a table or a backup, read-only with SQLite alone (nothing of it changed)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(query).fetchall()
    finally:
        db.close()


def backup_ids(table: Path) -> set[str]:
    return {row[0] for row in read(backup_path(table), "SELECT id FROM jobs")}


# -- the message and its commands, on the table alone ------------------------------------------------------------
@pytest.mark.parametrize("how", ["overwritten", "cut short", "emptied", "a page garbled"])
def test_a_damaged_table_names_the_file_its_backup_and_commands_that_restore_it(tmp_path, how):
    table = tmp_path / "state" / "jobs.sqlite"
    saved = set(fill_table(table, jobs=20, steps=300))
    take_backup(table)
    fill_table(table, jobs=1, steps=3, first=20)        # after the backup: not in it
    garble(table, how)
    with pytest.raises(JobTableDamaged) as damaged:
        JobTable(table)
    message = str(damaged.value)
    assert message.startswith(f"the job table {table} is damaged (")
    assert "to go back to its backup of " in message and "(20 jobs)" in message, message
    assert str(backup_path(table).name) in message and str(table.parent) in message
    subprocess.run(the_command(message), shell=True, check=True)
    assert job_ids(table) == saved
    kept = [folder for folder in table.parent.iterdir() if folder.name.startswith("damaged-")]
    assert len(kept) == 1 and (kept[0] / "jobs.sqlite").is_file(), kept   # the damaged file is kept, not deleted


def test_with_its_backup_damaged_too_or_none_the_command_starts_an_empty_table(tmp_path):
    table = tmp_path / "jobs.sqlite"
    fill_table(table, jobs=5, steps=10)
    garble(table, "overwritten")
    with pytest.raises(JobTableDamaged, match=r"its backup .*jobs\.sqlite\.backup: there is none yet; to start over "
                                              r"with an empty job table"):
        JobTable(table)
    fill_table(tmp_path / "other.sqlite", jobs=5, steps=10)
    take_backup(tmp_path / "other.sqlite")
    backup_path(tmp_path / "other.sqlite").rename(backup_path(table))
    garble(backup_path(table), "overwritten")
    with pytest.raises(JobTableDamaged) as damaged:
        JobTable(table)
    message = str(damaged.value)
    assert "its backup" in message and "it is damaged too (file is not a database)" in message, message
    subprocess.run(the_command(message), shell=True, check=True)
    assert job_ids(table) == set()
    assert not backup_path(table).exists()           # moved aside with the table, not left to be restored


def test_a_read_that_meets_damage_after_the_table_opened_says_the_same(tmp_path):
    """The file garbled under an open table (another process writing over it): the next read that needs a page
    SQLite has not cached fails with the same line. The table is larger than SQLite's page cache (2 MiB)."""
    path = tmp_path / "jobs.sqlite"
    ids = fill_table(path, jobs=40, steps=2000)
    assert path.stat().st_size > 4 * 2**20
    take_backup(path)
    table = JobTable(path)
    try:
        path.write_bytes(os.urandom(path.stat().st_size))   # the same file (inode), its bytes replaced
        with pytest.raises(JobTableDamaged, match=rf"the job table {path} is damaged .* to go back to its backup"):
            for job_id in ids:
                table.progress.of_job(job_id)
    finally:
        table.close()


# -- the backup -----------------------------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from actors.spec.job_submission import JobSubmission
    from actors.service.table.job_table import JobTable
    table = JobTable(sys.argv[1])
    table.db.execute("PRAGMA wal_autocheckpoint = 10")   # the main file rewritten all the time, not every 4 MB
    sub = JobSubmission.model_validate({"job": {"name": "w", "data": "/d.jsonl", "format": {"type": "alpaca"}},
                                        "base_model": "m"})
    ids = [table.add(f"w{i}", sub, Path(f"/out/w{i}")).id for i in range(8)]
    step = 0
    stop = Path(sys.argv[2])
    while not stop.exists():
        for job_id in ids:
            with table.transaction():   # 25 rows and the job's step, together (the log is checkpointed often)
                for row in range(step + 1, step + 26):
                    table.progress.add(job_id, {"step": row, "loss": 1.0, "tokens": 10})
                table.update(job_id, step=step + 25, tokens=10 * (step + 25))
        step += 25
""")


def test_a_backup_taken_while_another_process_writes_is_a_consistent_snapshot(tmp_path):
    path = tmp_path / "jobs.sqlite"
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(stop)])
    try:
        def written() -> bool:
            try:
                return read(path, "SELECT COUNT(*) FROM progress")[0][0] > 5000
            except sqlite3.Error:   # not created yet
                return False

        wait_for(written, timeout=120, what="the writer to write")
        totals = []
        for _ in range(25):
            take_backup(path)
            copy = sqlite3.connect(f"file:{backup_path(path)}?mode=ro", uri=True)
            try:
                assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
                rows = dict(copy.execute("SELECT job_id, COUNT(*) FROM progress GROUP BY job_id"))
                steps = dict(copy.execute("SELECT id, step FROM jobs"))
                assert rows == {job: step for job, step in steps.items() if step}, (rows, steps)
                totals.append(sum(rows.values()))
            finally:
                copy.close()
        assert writer.poll() is None, "the writer stopped: the backups were not taken during writes"
        assert totals == sorted(totals) and totals[-1] > totals[0], totals   # each one a later moment
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert writer.returncode == 0


def test_backups_are_taken_at_start_on_schedule_and_at_close_and_never_replace_a_sound_copy(tmp_path, caplog):
    path = tmp_path / "jobs.sqlite"
    fill_table(path, jobs=3, steps=5)
    (tmp_path / ".jobs.sqlite.backup.x1.tmp").write_bytes(b"left by a crash mid-copy")
    backups = TableBackups(path, every_s=0.2).start()
    wait_for(lambda: backups.taken >= 3, timeout=60, what="three scheduled backups")
    assert not list(tmp_path.glob(".jobs.sqlite.backup.*.tmp"))
    fill_table(path, jobs=1, steps=1, first=3)
    backups.close()
    taken = backups.taken
    assert backup_ids(path) == job_ids(path) and len(backup_ids(path)) == 4   # the last copy: the table as left
    sound = backup_path(path).read_bytes()
    garble(path, "a page garbled")
    caplog.set_level(logging.ERROR)
    assert not backups.take()
    assert backups.taken == taken and backup_path(path).read_bytes() == sound
    assert f"the job table {path} is damaged" in caplog.text and "to go back to its backup" in caplog.text


# -- the entry points -----------------------------------------------------------------------------------------------
def test_aspen_report_and_export_on_a_damaged_table_say_so_in_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "job-a").mkdir(parents=True)
    (run / "job-a" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens": 10}\n'
                                                 '{"step": 2, "loss": 1.5, "tokens": 10}\n')
    table = run / ".aspen" / "jobs.sqlite"
    fill_table(table, jobs=2, steps=2)
    take_backup(table)
    garble(table, "overwritten")

    def aspen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)

    report = aspen("report", str(run))
    assert report.returncode == 0 and (run / "report.md").is_file(), report.stderr   # the report, without states
    lines = [line for line in report.stderr.splitlines() if "jobs.sqlite" in line]
    assert len(lines) == 1 and "Traceback" not in report.stderr, report.stderr
    assert f"the job table {table} is damaged" in lines[0] and "to go back to its backup" in lines[0], lines
    export = aspen("export", "job-0", "--from", str(run))
    assert export.returncode == 1 and "Traceback" not in export.stderr, export.stderr
    assert export.stderr.count("\n") == 1 and export.stderr.startswith(f"aspen: the job table {table} is damaged")
    assert "run: mkdir" in export.stderr, export.stderr


def service_config(state_dir: Path, base: Path) -> ServiceConfig:
    """The shared one-trainer service, without MQTT events or a metrics endpoint."""
    return shared_service_config(state_dir, base, listeners=NO_LISTENERS)


def test_a_service_on_a_damaged_table_says_so_in_one_line_and_starts_again_from_its_backup(
        ray_session, tiny_model_dirs, tmp_path):
    state = tmp_path / "state"
    config = service_config(state, tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "held")
    client = Client.local(config, wait_ready=False)
    try:
        handles = client.submit_run(run_spec(NOBODYS_MODEL, tmp_path / "out",
                                             [job_dict("held-a", data, 5), job_dict("held-b", data, 5)]))
    finally:
        client.shutdown()                       # a clean stop writes the last backup
    submitted = {handle.id for handle in handles}
    assert backup_ids(state / "jobs.sqlite") == submitted
    garble(state / "jobs.sqlite", "overwritten")
    with pytest.raises(ServiceError) as refused:
        Client.local(config)
    message = str(refused.value)
    assert message.startswith(f"the aspen service could not start: the job table {state / 'jobs.sqlite'} is "
                              "damaged (file is not a database); to go back to its backup of "), message
    assert "(2 jobs)" in message
    subprocess.run(the_command(message), shell=True, check=True)
    client = Client.local(config, wait_ready=False)
    try:
        assert {record.id for record in client.jobs()} == submitted
        assert {record.name for record in client.jobs()} == {"held-a", "held-b"}
    finally:
        client.shutdown()


def test_aspen_run_on_ray_with_a_damaged_table_says_so_in_one_line(ray_session, tiny_model_dirs, tmp_path):
    data = write_task_data(tmp_path, "data")
    (tmp_path / "jobs.yaml").write_text(json.dumps({"base_model": str(tiny_model_dirs["llama"]), "output_dir": "out",
                                                    "step_tokens": 512, "jobs": [job_dict("job-a", data, 3)]}))
    table = tmp_path / "out" / ".aspen" / "jobs.sqlite"
    fill_table(table, jobs=1, steps=1)
    garble(table, "overwritten")
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "jobs.yaml", "-q"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("aspen: ")]
    assert lines == [line for line in run.stderr.splitlines() if "jobs.sqlite" in line], run.stderr
    assert len(lines) == 1 and lines[0].startswith(f"aspen: the aspen service could not start: the job table "
                                                   f"{table} is damaged"), run.stderr
    assert "there is none yet; to start over with an empty job table" in lines[0], lines
