"""The sweeps a service runs (Ray-free: the scheduler holds one and polls it in its loop).

`add(spec)` takes a validated sweep (a second `add` of the same sweep is the same sweep: it answers with it;
the same name with other settings is refused), `poll_all()` advances each one (a done one: only a trial its user
continued; `actors/service/sweeps/sweep_driver.py`), `status(name)` / `all()` answer with the leaderboard,
`cancel(name)` stops one. Each sweep's spec and state live in `<state_dir>/sweeps/<name>.json`, so a restarted
scheduler carries on every sweep where it was; when a trial ends (or is continued: `aspen extend`, `aspen resume`;
and ends again) and when the sweep ends, `leaderboard.json` and `report.png` (every trial's objective over its
steps, stopped trials marked) are written to the sweep's output folder. A sweep whose poll fails (its state file
cannot be written, a searcher raised) is marked failed with the error and the others go on; submitted again (or
the scheduler restarted), it is carried on."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from actors.data.formats import STORED
from actors.service.sweeps.replaced_sweeps import REPLACED_PREFIX, blocking_jobs, set_aside
from actors.service.sweeps.sweep_driver import SweepDriver, SweepJobs
from actors.service.sweeps.sweep_run import SearcherNotRestored
from actors.spec.sweep_spec import SweepSpec, trial_name
from actors.storage.durable import replace_durably, write_durably
from actors.storage.storage_uri import is_uri

log = logging.getLogger(__name__)
LEADERBOARD_FILE = "leaderboard.json"
REPORT_FILE = "report.png"


class SweepBook:
    def __init__(self, state_dir: Path, jobs: SweepJobs):
        self.folder = Path(state_dir) / "sweeps"
        self.jobs = jobs
        self.drivers: dict[str, SweepDriver] = {}
        self.errors: dict[str, str] = {}
        self.ended_seen: dict[str, tuple] = {}
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                stored = json.loads(path.read_text())
                spec = SweepSpec.model_validate(stored["spec"], context={STORED: True})
                self.drivers[spec.name] = SweepDriver(jobs, spec, path, say=log.info)
                if stored.get("failed"):   # held failed (not carried on) until it is submitted again
                    self.errors[spec.name] = (f"{stored['failed']} (before this service started; the same sweep "
                                              "submitted again carries it on, one of other settings replaces it)")
            except SearcherNotRestored as error:   # its searcher's bug or missing module: that sweep alone fails,
                self._hold(path, spec, error)         # its state file kept as it was
            except (ValueError, KeyError, OSError) as error:   # one damaged or unreadable file (a folder, no read
                # permission): that sweep is reported, the rest go on
                why = f"{type(error).__name__}: {error}" if isinstance(error, OSError) else str(error)
                self.errors[path.stem] = f"{path}: cannot be carried on ({why}); move it away to drop the sweep"
                log.error("sweeps: %s", self.errors[path.stem])

    def _hold(self, path: Path, spec: SweepSpec, error: SearcherNotRestored) -> None:
        """A sweep whose searcher cannot be restored (or built), held failed: shown with its trials (its searcher a
        `HeldSearcher`), cancelled, or replaced by a sweep of other settings as a failed sweep is; the same file
        submitted again builds its own searcher again (`add`). A cancelled one stays cancelled, the error in its
        `searcher_errors` (its plug-in's module removed after the cancel)."""
        try:
            driver = self.drivers[spec.name] = SweepDriver(self.jobs, spec, path, say=log.info, held=True)
        except Exception:   # its state unreadable even so: held failed without its trials
            log.exception("sweeps: sweep '%s' cannot be shown either", spec.name)
            driver = None
        if driver is not None and driver.cancelled:
            driver.run.searcher.kept({"count": 1, "last": [f"as the service started: {error}"]})
            log.warning("sweeps: cancelled sweep '%s': %s", spec.name, error)
            return
        self.errors[spec.name] = (f"{path}: {error}; or submit a sweep '{spec.name}' of other settings to replace it "
                                  f"(its results move to {spec.output_dir}/{REPLACED_PREFIX}<k>/), or cancel it "
                                  f"(aspen sweep cancel {spec.name})")
        log.error("sweeps: %s", self.errors[spec.name])

    def check(self, spec: SweepSpec) -> bool:
        """What `add` would refuse of `spec` (ValueError; its user's quota, for its first trial: the scheduler's
        QuotaExceeded), nothing added: True where it would be a new sweep, False where it is the same sweep as one
        known (`add` answers with it)."""
        if is_uri(spec.output_dir):
            raise ValueError(f"sweep '{spec.name}': output_dir {spec.output_dir} is a storage URI; a sweep's folder "
                             "(its leaderboard and report) is a local path for now")
        known = self.drivers.get(spec.name)
        if known is not None and known.spec == spec:
            return False
        state = self.status(spec.name)["state"] if known is not None else None
        if state in ("running", "done"):   # a failed or cancelled sweep's name is free again
            raise ValueError(f"sweep '{spec.name}' exists with other settings ({state}); give the sweep another "
                             "name"
                             + (f", or cancel it first (aspen sweep cancel {spec.name}; where its service is no "
                                f"longer running, as after an interrupted `aspen sweep FILE`: aspen sweep cancel "
                                f"{spec.name} --from {known.spec.output_dir}), then submit this one again"
                                if state == "running" else ""))
        busy = blocking_jobs(known) if known is not None else []
        if busy:   # a failed sweep's trials still training, or trials its user continued: their folders are in use
            raise ValueError(f"sweep '{spec.name}' ({state}) exists with other settings and its trials' jobs "
                             f"{', '.join(busy)} still train in its folder; cancel them (aspen sweep cancel "
                             f"{spec.name}, or aspen cancel JOB) or let them end, then submit this sweep again")
        problem = self.jobs.folder_problem(spec.job, base_model=spec.base_model, seed=spec.seed,
                                           output_dir=str(Path(spec.output_dir) / spec.job.name), user=spec.user)
        if problem is not None:   # else each trial would be refused when the sweep starts it
            raise ValueError(f"sweep '{spec.name}': its trials cannot write under output_dir {spec.output_dir}: "
                             f"{problem}")
        # a sweep whose first trial its user's quota refuses now is refused as that job would be (QuotaExceeded:
        # the HTTP API's 429 with Retry-After); a later trial the quota refuses waits (SweepDriver.waiting)
        first = trial_name(spec.job.name, 0)
        self.jobs.check_quota(spec.job.model_copy(update={"name": first}), base_model=spec.base_model,
                              seed=spec.seed, output_dir=str(Path(spec.output_dir) / first), user=spec.user)
        return True

    def add(self, spec: SweepSpec) -> dict[str, Any]:
        """A new sweep started, or the same one answered; the same sweep that failed (its poll raised: a state file
        not written, a searcher's error) is carried on from where it was, as a restarted scheduler carries it on (a
        cause not gone fails it again, saying so)."""
        if not self.check(spec):
            if self.drivers[spec.name].run.held:   # its own searcher built and restored again (raises where it still
                self.drivers[spec.name] = SweepDriver(self.jobs, spec, self.drivers[spec.name].state_path,  # cannot)
                                                      say=log.info)
            if self.errors.pop(spec.name, None) is not None:
                log.info("sweeps: sweep '%s' submitted again after it failed: carried on", spec.name)
                try:
                    self.drivers[spec.name].save()   # its failure no longer noted in its state file
                except OSError as error:   # its next poll says so again where the cause is not gone
                    log.warning("sweeps: sweep '%s': %s", spec.name, error)
            return self.status(spec.name)
        replaced = None
        if spec.name in self.drivers:   # a failed or cancelled sweep of that name: its results set aside, then replaced
            old_state = self.status(spec.name)["state"]
            replaced = set_aside(self.drivers[spec.name], old_state, str(spec.output_dir))
            self._keep_state(spec.name)
            del self.drivers[spec.name]
            self.ended_seen.pop(spec.name, None)
        driver = SweepDriver(self.jobs, spec, self.folder / f"{spec.name}.json", say=log.info)
        driver.run.replaced = replaced   # in its status and state file from now on (None: it replaced none)
        driver.save()
        self.drivers[spec.name] = driver
        self.errors.pop(spec.name, None)
        return self.status(spec.name)

    def _keep_state(self, name: str) -> None:
        """A replaced sweep's state file kept as `<state_dir>/sweeps/replaced/<name>-<k>.json` (not carried on)."""
        path = self.folder / f"{name}.json"
        if not path.exists():
            return
        (self.folder / "replaced").mkdir(exist_ok=True)
        k = 1
        while (self.folder / "replaced" / f"{name}-{k}.json").exists():
            k += 1
        replace_durably(path, self.folder / "replaced" / f"{name}-{k}.json")

    def poll_all(self) -> None:
        for name, driver in self.drivers.items():
            if name in self.errors:   # a done sweep is polled too: a trial of it its user continues is followed
                continue
            try:
                driver.poll()
                ended = self._ended(driver)
                if ended != self.ended_seen.get(name):   # a trial ended (or was continued): the results on disk follow
                    self.ended_seen[name] = ended
                    self._write_results(driver)
            except Exception as error:   # one sweep's failure is its own (logged, in its status); the others go on
                self.errors[name] = f"{type(error).__name__}: {error}"
                log.exception("sweeps: sweep '%s' failed", name)
                _note_failed(driver, self.errors[name])

    def cancel(self, name: str, reason: str = "cancelled by the user") -> dict[str, Any]:
        """The sweep cancelled (`SweepDriver.cancel`), a failed one too: it is followed again until its trials' jobs
        end, and ends `cancelled`. What went wrong on the way (its searcher raising, as a failed sweep's may, its
        state not written) is logged and answered in `problems`: the cancel itself does not fail."""
        driver = self._driver(name)
        failed = self.errors.pop(name, None)
        try:
            problems = driver.cancel(reason)
        except Exception as error:  # noqa: BLE001 - its state not written (a full disk): cancelled here all the same
            problems = [*driver.run.quiet(log.warning), f"its state is not written: {type(error).__name__}: {error}"]
        for problem in problems:
            log.warning("sweeps: sweep '%s' cancelled: %s", name, problem)
        answer = self.status(name)
        return {**answer, "problems": problems, **({"failed_before": failed} if failed else {})}

    def status(self, name: str) -> dict[str, Any]:
        """The sweep's leaderboard (`{"trials", "best"}`) with its name, state (running, done, cancelled,
        failed), error, what its searcher raised once quieted (`searcher_errors`: a cancelled sweep's; None), why
        its next trials wait to be submitted (`waiting`: its user's quota; None), trial count
        and folder."""
        if name in self.errors and name not in self.drivers:
            return {"name": name, "state": "failed", "error": self.errors[name], "waiting": None, "trials": [],
                    "best": None}
        driver = self._driver(name)
        state = ("failed" if name in self.errors else "cancelled" if driver.cancelled and driver.done
                 else "done" if driver.done else "running")
        return {"name": name, "state": state, "error": self.errors.get(name), "waiting": driver.waiting,
                "searcher_errors": driver.run.searcher_errors(), "trials_planned": driver.run.total,
                "replaced": driver.run.replaced,
                "output_dir": str(driver.spec.output_dir), "user": driver.spec.user, **driver.leaderboard()}

    def all(self) -> list[dict[str, Any]]:
        return [self.status(name) for name in sorted({*self.drivers, *self.errors})]

    def _driver(self, name: str) -> SweepDriver:
        try:
            return self.drivers[name]
        except KeyError:
            raise KeyError(f"no sweep named '{name}' (sweeps: {', '.join(sorted(self.drivers)) or 'none'})") from None

    @staticmethod
    def _ended(driver: SweepDriver) -> tuple:
        """The trials that ended as they ended (a continued one: that it was continued)."""
        return tuple((name, t.state, t.objective if t.state != "continued" else None)
                     for name, t in driver.run.trials.items() if t.state not in ("pending", "running"))

    def _write_results(self, driver: SweepDriver) -> None:
        folder = Path(driver.spec.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        board = driver.run.leaderboard()
        # named, so that `aspen sweep status FOLDER` says which sweep it was (the folder is any name)
        write_durably(folder / LEADERBOARD_FILE, json.dumps({"name": driver.spec.name, **board}, indent=1))
        write_report(folder / REPORT_FILE, driver.spec, board, driver.curves())


def _note_failed(driver: SweepDriver, error: str) -> None:
    """The failure written into the sweep's state file (as it was last written), so that a service started again on
    it holds the sweep failed, as this one does: `aspen sweep FILE` of other settings then replaces it, the same
    file carries it on. A state file that cannot be written (a full disk) is left: a restart carries the sweep on."""
    try:
        stored = json.loads(driver.state_path.read_text())
        write_durably(driver.state_path, json.dumps({**stored, "failed": error}, indent=1))
    except (OSError, ValueError) as problem:
        log.warning("sweeps: sweep '%s': its failure is not noted in %s (%s): a restart carries it on",
                    driver.spec.name, driver.state_path, problem)


def write_report(path: Path, spec: SweepSpec, board: dict[str, Any],
                 curves: dict[str, list[tuple[int, float]]]) -> None:
    """`report_figure` saved as a PNG at `path` (`durable.write_durably`: whole, or the old one left)."""
    import matplotlib.pyplot as plt

    figure = report_figure(spec, board, curves)
    try:
        write_durably(path, lambda temporary: figure.savefig(temporary, format="png", bbox_inches="tight"))
    finally:
        plt.close(figure)


def trial_label(trial: dict[str, Any], best: bool) -> str:
    """A trial as its curve's legend names it: its name, its settings, and how it ended."""
    settings = ", ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in trial["settings"].items())
    end = (" (best)" if best else f" (stopped at step {trial['steps']})" if trial["state"] == "stopped"
           else "" if trial["state"] == "completed" else f" ({trial['state']})")
    return f"{trial['name']}: {settings}{end}"


def report_figure(spec: SweepSpec, board: dict[str, Any], curves: dict[str, list[tuple[int, float]]]) -> Any:
    """One plot of every trial's objective over its steps, each curve named with its trial's settings in the
    legend: completed trials as lines, stopped ones ending in an x at the step they were stopped, the best one
    thick; whole steps on the step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(11, 5), dpi=100)
    for trial in board["trials"]:
        points = curves.get(trial["name"]) or []
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        best = trial["name"] == board["best"]
        line, = axes.plot(steps, values, linewidth=2.5 if best else 1.0, alpha=1.0 if best else 0.7,
                          marker="o" if len(points) == 1 else None, label=trial_label(trial, best))
        if trial["state"] == "stopped":
            axes.plot(steps[-1], values[-1], "x", color=line.get_color(), markersize=8)
    axes.plot([], [], "x", color="gray", label="x: where a trial was stopped")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(spec.objective.replace("_", " ") if isinstance(spec.objective, str)
                    else f"{spec.objective.metric} (higher is better)")
    axes.set_title(f"sweep {spec.name}: {len(board['trials'])} trials")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.tight_layout()
    return figure
