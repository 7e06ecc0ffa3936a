"""The scenario that the metrics tests read (tests/unit/service/test_metrics_endpoint.py,
test_grafana_dashboards.py; the `scenario` fixture of tests/unit/service/conftest.py): a real trainer loop on a
tiny model and a real scheduler core (job table, fifo policy) drive a `MetricsListener` the way the scheduler
actor does, and its `/metrics` page is scraped over HTTP, read with prometheus_client's own text parser, while a
job runs and after both ended."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from actors.engine.models import load_base_model
from actors.service.scheduler.config import MetricsConfig, TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobRecord, JobTable
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.service.trainer.trainer_reports import TrainerStatus
from orchestrator.metrics import MetricsListener
from policies.base import Start
from policies.fifo import FifoPolicy
from tests.helpers.service import job_dict, run_spec, write_task_data

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> tuple[Samples, dict[str, tuple[str, str]]]:
    """Every sample of the page, keyed by (sample name, labels), and each sample name's (family, type).
    The `_created` samples (creation timestamps that prometheus_client adds to counters and histograms)
    are left out."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: Samples = {}
    families: dict[str, tuple[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            families[sample.name] = (family.name, family.type)
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, families


@dataclass
class Scenario:
    listener: MetricsListener
    table: JobTable
    status: TrainerStatus          # the last status the listener heard
    steps: list[dict]              # every step row the listener heard
    short: str                     # completed after 3 steps
    long: str                      # running at `during`, cancelled at `after`
    during: tuple[Samples, dict[str, tuple[str, str]]]
    after: tuple[Samples, dict[str, tuple[str, str]]]
    during_records: dict[str, JobRecord]   # the job table at `during`


def assignment_for(table: JobTable, job_id: str, tokenizer) -> Assignment:
    submission = table.submission(job_id)
    data = JobData(job_id, submission, tokenizer)
    summary = data.prepare()
    return Assignment(job_id=job_id, submission=submission, output_dir=Path(submission.output_dir), data=summary,
                      eval_examples=data.eval_examples(), link=LocalJobLink(data))


@contextlib.contextmanager
def metrics_scenario(tiny_model_dirs, tmp_path_factory) -> Iterator[Scenario]:
    """Two jobs on a one-slot trainer: `short` runs 3 steps while `long` waits for the slot (a deferral),
    then `long` runs until it is cancelled. Each round does what the scheduler actor's tick does."""
    tmp = tmp_path_factory.mktemp("metrics")
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    listener = MetricsListener(MetricsConfig(port=0))
    url = listener.describe()["metrics_url"]
    table = JobTable(tmp / "state/jobs.sqlite", on_change=listener.job_changed)
    core = SchedulerCore(table, FifoPolicy(), tmp / "state", on_decision=listener.decided)
    data = tmp / "data"
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp / "out",
                    [job_dict("short", write_task_data(data, "short"), 3),
                     job_dict("long", write_task_data(data, "long", offset=4), 500)], step_tokens=512)
    loop = TrainerLoop(base, TrainerConfig(base_model=spec.base_model, step_tokens=512, max_jobs=1), "trainer-0",
                       tmp / "state")
    short, long = (core.submit(s).id for s in spec.submissions())
    steps: list[dict] = []

    def run_until(done, limit: int = 200) -> TrainerStatus:
        for _ in range(limit):
            for action in core.plan([loop.status()]):
                if isinstance(action, Start):
                    loop.assign(assignment_for(table, action.job, base.tokenizer))
            loop.run_once(idle_wait=0)
            events = loop.drain_events()
            for event in events:
                core.apply_event("trainer-0", event)
            status = loop.status()
            listener.trainer_polled(status, events)
            listener.tick(table.all(), table.counts(), [status])
            listener.accounts(table.usage.ever_used())   # as the scheduler actor does
            steps.extend(e.data for e in events if e.kind == "step")
            if done():
                return status
        raise AssertionError("the scenario did not reach its state")

    try:
        run_until(lambda: table.get(short).state == "completed" and table.get(long).step >= 2)
        during = scrape(url)
        during_records = {r.id: r for r in table.all()}
        _, stop = core.cancel(long, "enough")
        loop.stop_job(stop.job, stop.kind, stop.reason)
        status = run_until(lambda: table.get(long).state == "cancelled")
        after = scrape(url)
        yield Scenario(listener, table, status, list(steps), short, long, during, after, during_records)
    finally:
        listener.close()
        table.close()
