"""`aspen watch` and `aspen report` on a real service run laid out like `aspen run` (jobs in
`<run>/<job>/`, the service state in `<run>/.aspen/`). The service's MQTT broker is a port where nothing
listens: its jobs must train to completion all the same."""

from __future__ import annotations

import json
import re
import time

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from rich.console import Console

from actors.service.scheduler.config import SCHEDULER_NAME, ServiceConfig, TrainerConfig
from actors.service.table.job_table import JobRecord
from orchestrator.cli import main
from orchestrator.client import Client
from orchestrator.watch import eta_seconds, watch
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, run_spec, wait_for, write_task_data


@pytest.fixture(scope="module")
def finished_run(ray_session, tiny_model_dirs, tmp_path_factory):
    """A service (named like `aspen serve`'s, so that the CLI finds it) whose MQTT broker is down, and a
    run of two jobs trained to the end; yields (client, run folder, records, dead broker URL)."""
    run_dir = tmp_path_factory.mktemp("run")
    base = tiny_model_dirs["llama"]
    dead_broker = f"mqtt://127.0.0.1:{free_port()}"
    trainer = TrainerConfig(base_model=str(base), step_tokens=512, num_cpus=0.5, threads=1)
    config = ServiceConfig(state_dir=run_dir / ".aspen", trainers=[trainer], tick_seconds=0.1,
                           events={"broker": dead_broker})
    client = Client.local(config, name=SCHEDULER_NAME)
    try:
        data = run_dir.parent / f"{run_dir.name}-data"
        jobs = [job_dict("alpha", write_task_data(data, "alpha"), 6, eval_split=0.25, eval_every=2),
                job_dict("beta", write_task_data(data, "beta", offset=5), 4)]
        handles = client.submit_run(run_spec(str(base), run_dir, jobs, step_tokens=512))
        records = client.wait_all([h.id for h in handles], timeout=180)
        yield client, run_dir, records, dead_broker
    finally:
        client.shutdown()


def test_jobs_train_to_completion_while_the_mqtt_broker_is_down(finished_run):
    client, _, records, dead_broker = finished_run
    info = client.info()
    # the service did try to publish to the dead broker: every event it had waits for it (fewer than its
    # queue holds: none dropped), and the jobs trained all the same
    assert info["mqtt_url"] == dead_broker and info["mqtt_connected"] == "no"
    assert int(info["mqtt_waiting"]) >= len(records) * 2 and info["mqtt_dropped"] == "0"   # each job's start, end
    assert [(r.name, r.state, r.step) for r in records] == [("alpha", "completed", 6), ("beta", "completed", 4)]


def test_watch_once_shows_every_job_with_its_progress_and_eta(finished_run, tmp_path, capsys):
    client, _, records, _ = finished_run
    long = client.submit(job_dict("long", write_task_data(tmp_path, "long"), 5000),
                         base_model=records[0].base_model, output_dir=tmp_path / "long")
    try:
        wait_for(lambda: client.status(long.id).step >= 3 and client.status(long.id).tokens_per_s, timeout=60,
                 what="the long job to train")
        assert main(["watch", "--once"]) == 0
        shown = capsys.readouterr().out
    finally:
        client.cancel(long.id)
        long.wait(timeout=60)
    lines = {line.split("│")[1].strip(): line for line in shown.splitlines() if line.count("│") > 3}
    for record in records:
        line = lines[record.id]
        assert "completed" in line and f"{record.step}/{record.total_steps}" in line
        assert f"{record.loss:.4f}" in line
    cells = [cell.strip() for cell in lines[long.id].split("│")]
    assert cells[2] == "running" and re.fullmatch(r"\d+/5000", cells[3])
    assert re.fullmatch(r"(\d+h)?(\d+m)?\d+s|\d+h\d\dm", cells[7]), cells   # an ETA, not '-'


def test_watch_refreshes_live_until_its_duration(finished_run):
    client, _, records, _ = finished_run
    fetched = []

    def fetch() -> list[JobRecord]:
        fetched.append(time.time())
        return client.jobs()

    console = Console(record=True, width=160, force_terminal=True)
    last = watch(fetch, interval=0.2, duration=1.0, console=console)
    assert len(fetched) >= 4 and {r.id for r in records} <= {r.id for r in last}
    shown = console.export_text()
    assert all(r.id in shown for r in records) and "ETA" in shown


def test_eta_comes_from_tokens_per_second_or_steps_per_second():
    now = time.time()
    record = JobRecord(id="j-1", name="j", state="running", reason="", base_model="m", quantization="none", priority=0,
                       output_dir="/o", trainer="trainer-0", step=10, total_steps=110, tokens=1000, loss=1.0,
                       eval_loss=None, tokens_per_s=50.0, checkpoint_step=None, adapter_dir=None, submitted_at=now - 30,
                       started_at=now - 20, finished_at=None, updated_at=now)
    assert eta_seconds(record, now) == pytest.approx(100 * 100 / 50.0)     # 100 steps x 100 tokens at 50 tokens/s
    record.tokens_per_s = None
    assert eta_seconds(record, now) == pytest.approx(100 / (10 / 20))      # 10 steps in 20 s
    record.state = "completed"
    assert eta_seconds(record, now) is None


def test_report_writes_loss_curves_and_a_table_read_back_from_metrics(finished_run, capsys):
    client, run_dir, records, _ = finished_run
    assert main(["report", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    png = run_dir / "report.png"
    image = matplotlib.image.imread(png)[..., :3]
    height, width = image.shape[:2]
    assert (width, height) == (1000, 600)
    # each job's curve is drawn in its own colour of matplotlib's default cycle (alpha C0, beta C1) across the
    # plot, not only in the legend (a short sample in a corner): a blank or legend-only figure fails here
    for index, record in enumerate(records):
        colour = matplotlib.colors.to_rgb(f"C{index}")
        columns = np.flatnonzero((np.abs(image - colour).max(axis=-1) < 0.02).any(axis=0))
        assert columns.size and columns.max() - columns.min() > 0.5 * width, (record.name, columns[:5])
    table = (run_dir / "report.md").read_text()
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in table.splitlines() if line.startswith("| "))}
    assert set(rows) == {"job", "alpha", "beta"}
    for record in records:
        metrics = [json.loads(line) for line in (run_dir / record.name / "metrics.jsonl").read_text().splitlines()]
        name, steps, final, best_eval, tokens, state = rows[record.name]
        assert (int(steps), float(final)) == (metrics[-1]["step"], pytest.approx(metrics[-1]["loss"], abs=5e-5))
        assert int(tokens) == sum(row["tokens"] for row in metrics) and state == "completed"
        evals = [row["eval_loss"] for row in client.losses(record.id) if row["eval_loss"] is not None]
        assert best_eval == (f"{min(evals):.4f}" if evals else "-")
        assert record.name in printed
    assert rows["alpha"][3] != "-" and rows["beta"][3] == "-"   # alpha has an eval split, beta none


def test_read_commands_print_json(finished_run, capsys):
    """`--json` on status (all jobs; one job with its history), watch --once and report: what the table
    shows, machine-readable."""
    client, run_dir, records, _ = finished_run

    def printed(*argv: str):
        assert main(list(argv)) == 0
        return json.loads(capsys.readouterr().out)

    jobs = {j["id"]: j for j in printed("status", "--json")}
    watched = {j["id"]: j for j in printed("watch", "--once", "--json")}
    for record in records:
        assert jobs[record.id]["state"] == watched[record.id]["state"] == "completed"
        assert jobs[record.id]["step"] == record.step and jobs[record.id]["loss"] == pytest.approx(record.loss)
        one = printed("status", record.id, "--json")
        assert one["id"] == record.id
        assert [h["state"] for h in one["history"]] == [state for _, state, _ in client.transitions(record.id)]
        assert one["history"][-1]["state"] == "completed"
    report = {j["job"]: j for j in printed("report", str(run_dir), "--json")}
    assert not (run_dir / "report.json").exists()
    for record in records:
        metrics = [json.loads(line) for line in (run_dir / record.name / "metrics.jsonl").read_text().splitlines()]
        job = report[record.name]
        assert job["steps"] == metrics[-1]["step"] and job["state"] == "completed"
        assert [p["loss"] for p in job["losses"]] == pytest.approx([row["loss"] for row in metrics])
        assert job["tokens"] == sum(row["tokens"] for row in metrics)
    assert report["alpha"]["evals"] and report["beta"]["evals"] == []


def test_pause_resume_and_cancel_from_the_command_line(finished_run, tmp_path, capsys):
    client, _, records, _ = finished_run
    long = client.submit(job_dict("long-cli", write_task_data(tmp_path, "long-cli"), 5000),
                         base_model=records[0].base_model, output_dir=tmp_path / "long-cli")
    try:
        wait_for(lambda: client.status(long.id).step >= 2, timeout=60, what="the job to train")
        assert main(["pause", long.id]) == 0
        assert capsys.readouterr().out.startswith(f"{long.id}: ")
        paused = wait_for(lambda: client.status(long.id).state == "paused" and client.status(long.id),
                          timeout=60, what="the job to pause")
        assert paused.checkpoint_step >= 2
        assert main(["resume", long.id, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] in ("queued", "running")
        wait_for(lambda: client.status(long.id).step > paused.step, timeout=60, what="the job to go on")
    finally:
        assert main(["cancel", long.id, "--json"]) == 0
        capsys.readouterr()
        assert long.wait(timeout=60).state == "cancelled"
    assert main(["cancel", "no-such-job"]) == 2
    assert "no job with id or name 'no-such-job'" in capsys.readouterr().err


def test_watch_json_needs_once_or_events(capsys):
    assert main(["watch", "--json"]) == 2
    assert "--json goes with --once" in capsys.readouterr().err


def test_report_names_the_folder_when_there_are_no_metrics(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path) in error and "metrics.jsonl" in error
