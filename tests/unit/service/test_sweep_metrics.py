"""The sweeps' series on the service's `/metrics` page (orchestrator/metric_families.py, SweepMetrics), fed the
statuses of a real SweepBook whose trials run on a fake job service (tests/helpers/sweep_jobs.py), the way the
scheduler feeds them every tick, and read from the page with prometheus_client's text parser: a sweep's series
stay while it runs and ENDED_SWEEP_SERIES_S after it ended, then go, so that a service that runs sweep after
sweep keeps a bounded page; a sweep that runs again has them again."""

from __future__ import annotations

from actors.service.scheduler.config import MetricsConfig
from actors.service.sweeps.sweep_book import SweepBook
from orchestrator.metric_families import ENDED_SWEEP_SERIES_S
from orchestrator.metrics import MetricsListener
from tests.helpers.metrics_scenario import scrape
from tests.helpers.sweep_jobs import FakeJobs, spec


def sweeps_on_page(listener: MetricsListener) -> dict[str, int]:
    """Each sweep named on the page: its number of series."""
    samples, _ = scrape(listener.url)
    found: dict[str, int] = {}
    for name, labels in samples:
        if name.startswith("aspen_sweep_"):
            sweep = dict(labels)["sweep"]
            found[sweep] = found.get(sweep, 0) + 1
    return found


def test_an_ended_sweeps_series_go_after_a_while_and_the_page_stays_bounded(tmp_path):
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    listener = MetricsListener(MetricsConfig(port=0))
    now = [0.0]
    listener.sweep_metrics.clock = lambda: now[0]
    try:
        def run_sweep(name: str) -> None:
            book.add(spec(name, tmp_path / "out"))
            while book.status(name)["state"] == "running":
                book.poll_all()
                listener.sweeps(book.all())
                jobs.advance()
                now[0] += 1.0
            listener.sweeps(book.all())

        run_sweep("first")
        assert book.status("first")["state"] == "done"
        assert sweeps_on_page(listener) == {"first": 8}     # 7 trial states and its best objective
        now[0] += ENDED_SWEEP_SERIES_S / 2
        listener.sweeps(book.all())
        assert sweeps_on_page(listener) == {"first": 8}     # ended a while ago: still there to be scraped
        now[0] += ENDED_SWEEP_SERIES_S
        listener.sweeps(book.all())
        assert sweeps_on_page(listener) == {}               # gone
        for number in range(12):                            # sweep after sweep, one every 100 s
            run_sweep(f"s{number}")
            now[0] += 100.0
            listener.sweeps(book.all())
        shown = sweeps_on_page(listener)
        assert shown and len(shown) <= ENDED_SWEEP_SERIES_S / 100 + 1, shown
        assert set(shown) == {f"s{n}" for n in range(12 - len(shown), 12)}   # the latest ones
        book.add(spec("again", tmp_path / "out"))           # a running sweep has its series whatever the clock
        book.poll_all()
        listener.sweeps(book.all())
        assert book.status("again")["state"] == "running" and sweeps_on_page(listener)["again"] == 7   # no best yet
    finally:
        listener.close()
