"""`aspen report RUN_DIR`: one loss curve per job (with its eval losses where known) in
`RUN_DIR/report.png`, and a summary table (job, steps, final loss, best eval loss, best eval score where a job
has an eval_generate metric, tokens, state, and the kept evaluation where a job ended keeping its best: its
adapter folder's aspen.json `best`) printed and written to `RUN_DIR/report.md`.

RUN_DIR is a run's output folder (`aspen run`: one folder per job, the service state in `.aspen/`) or a
service state folder (`jobs.sqlite`, `outputs/<job>/`). Each job's `metrics.jsonl` has one row per optimizer
step (step, loss, tokens, lr, grad_norm, and `eval_loss` where the job was evaluated after that step: every
run mode writes it, `--in-process` included); states, and the eval losses of runs older than that, come from
the job table when there is one (read-only; an in-process run records its jobs there as it ends), as do the jobs
of that table with no metrics.jsonl in RUN_DIR (failed or cancelled before their first step, or never started):
in the table with their state, without a curve.

RUN_DIR may be a storage URI (s3://bucket/runs/x, where a run's output_dir is one): the jobs' metrics are
read from there, and report.png / report.md are uploaded next to them (a URI run's job table stays on the
machine that ran it, so states are left out)."""

from __future__ import annotations

import json
import logging
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from actors.service.table.job_record import best_text
from actors.service.table.table_backup import damaged_message, is_damage
from actors.storage.base_identity import METADATA_NAME
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import StorageURI, as_location, is_uri

log = logging.getLogger(__name__)


class ReportError(ValueError):
    """RUN_DIR holds nothing to report on."""


@dataclass
class JobMetrics:
    name: str
    folder: Path | StorageURI
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    evals: dict[int, float] = field(default_factory=dict)   # step -> eval loss
    scores: dict[int, float] = field(default_factory=dict)  # step -> eval_generate score, where the job has one
    state: str | None = None
    kept: dict | None = None   # keep_best: aspen.json's `best` {metric, step, value}, the evaluation its adapter is

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def best_eval(self) -> float | None:
        return min(self.evals.values()) if self.evals else None

    @property
    def best_score(self) -> float | None:
        """The best eval_generate score (higher is better)."""
        return max(self.scores.values()) if self.scores else None


def read_metrics(path: Path, name: str) -> JobMetrics:
    return parse_metrics(path.read_text(), path, name, path.parent)


def parse_metrics(text: str, path: Path | str, name: str, folder: Path | StorageURI) -> JobMetrics:
    """A job's metrics from the text of its metrics.jsonl (`path`: where it came from, for errors)."""
    job = JobMetrics(name, folder)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ReportError(f"{path}, line {number}: not a metrics row with a 'step' ({error})") from None
        if row.get("loss") is not None:
            job.steps.append(step)
            job.losses.append(float(row["loss"]))
        job.tokens += int(row.get("tokens") or 0)
        if row.get("eval_loss") is not None:
            job.evals[step] = float(row["eval_loss"])
        if row.get("eval_score") is not None:
            job.scores[step] = float(row["eval_score"])
    return job


def _job_table(run_dir: Path) -> Path | None:
    for candidate in (run_dir / "jobs.sqlite", run_dir / ".aspen" / "jobs.sqlite"):
        if candidate.is_file():
            return candidate
    return None


def _add_table_facts(jobs: list[JobMetrics], database: Path, run_dir: Path) -> None:
    """States and eval losses from the service's job table, matched by output folder (read-only). A job of the
    table whose folder (`run_dir/<job>` or `run_dir/outputs/<job>`) has no metrics.jsonl, one that failed or was
    cancelled before its first step or never started, is added with its state and no steps."""
    by_folder = {job.folder.resolve(): job for job in jobs}
    roots = {run_dir.resolve(), (run_dir / "outputs").resolve()}
    try:
        db = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    except sqlite3.Error as error:
        log.warning("report: cannot open %s (%s); states and eval losses are left out", database, error)
        return
    try:
        newest: dict[Path, float] = {}
        for job_id, output_dir, state, submitted in db.execute("SELECT id, output_dir, state, submitted_at FROM jobs"):
            folder = Path(output_dir).resolve()
            if folder not in by_folder and folder.parent in roots:   # no metrics.jsonl: no step written
                by_folder[folder] = JobMetrics(folder.name, folder)
                jobs.append(by_folder[folder])
            job = by_folder.get(folder)
            if job is None or submitted < newest.get(folder, float("-inf")):
                continue   # an older job that wrote to the same folder
            newest[folder] = submitted
            job.state = state
            job.evals = {int(step): float(value) for step, value in db.execute(
                "SELECT step, eval_loss FROM progress WHERE job_id = ? AND eval_loss IS NOT NULL ORDER BY step",
                (job_id,))} or job.evals
    except sqlite3.Error as error:
        if is_damage(error):
            log.warning("report: %s; the report leaves out states and eval losses", damaged_message(database, error))
        else:
            log.warning("report: cannot read %s (%s); states and eval losses are left out", database, error)
    finally:
        db.close()


def collect(run_dir: Path | str) -> list[JobMetrics]:
    if is_uri(run_dir):
        return _collect_uri(str(run_dir))
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    files = sorted(run_dir.glob("*/metrics.jsonl")) + sorted(run_dir.glob("outputs/*/metrics.jsonl"))
    jobs = [read_metrics(path, path.parent.name) for path in files]
    for job, path in zip(jobs, files, strict=True):
        metadata = path.parent / METADATA_NAME
        job.kept = _kept(metadata.read_text(errors="replace") if metadata.is_file() else None, metadata)
    database = _job_table(run_dir)
    if database is not None:
        _add_table_facts(jobs, database, run_dir)
    if not jobs:
        raise ReportError(f"no metrics.jsonl in {run_dir}/<job>/ or {run_dir}/outputs/<job>/, and no job table: "
                          "give a run's output folder (output_dir of the jobs file) or the service's state folder")
    return jobs


def _collect_uri(uri: str) -> list[JobMetrics]:
    """The jobs' metrics under a storage URI: `<uri>/<job>/metrics.jsonl` and `<uri>/outputs/<job>/metrics.jsonl`."""
    location = StorageLocation(uri)
    jobs = []
    for prefix in ("", "outputs/"):
        for name in location.list(prefix):
            metrics, metadata = f"{prefix}{name}/metrics.jsonl", f"{prefix}{name}/{METADATA_NAME}"
            if location.exists(metrics):
                jobs.append(parse_metrics(location.read_bytes(metrics).decode("utf-8"), f"{uri}/{metrics}", name,
                                          as_location(f"{uri}/{prefix}{name}")))
                jobs[-1].kept = _kept(location.read_bytes(metadata).decode("utf-8", errors="replace")
                                      if location.exists(metadata) else None, f"{uri}/{metadata}")
    if not jobs:
        raise ReportError(f"no metrics.jsonl in {uri}/<job>/ or {uri}/outputs/<job>/: give a run's output_dir or a "
                          "service's output root")
    return jobs


def _kept(text: str | None, where: Path | str) -> dict | None:
    """The evaluation a keep_best job's adapter is (aspen.json's `best`), from the text of its aspen.json; None
    without one (no keep_best, not ended, no adapter written) or where it cannot be read (logged)."""
    if text is None:
        return None
    try:
        best = json.loads(text).get("best")
        return best if isinstance(best, dict) and {"metric", "step", "value"} <= best.keys() else None
    except (ValueError, AttributeError) as error:
        log.warning("report: %s is not the JSON object aspen writes (%s); its kept evaluation is left out", where,
                    error)
        return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def summary_rows(jobs: list[JobMetrics]) -> list[list[str]]:
    scored, kept = _scored(jobs), _kept_any(jobs)
    return [[job.name, str(job.steps[-1] if job.steps else 0), _fmt(job.final_loss), _fmt(job.best_eval),
             *([_fmt(job.best_score)] if scored else []), str(job.tokens), job.state or "-",
             *([best_text(job.kept)] if kept else [])] for job in jobs]


COLUMNS = ["job", "steps", "final loss", "best eval loss", "tokens", "state"]
KEPT_COLUMN = "kept adapter"   # a keep_best job's: the evaluation it ended with the adapter of


def _kept_any(jobs: list[JobMetrics]) -> bool:
    return any(job.kept is not None for job in jobs)


def _scored(jobs: list[JobMetrics]) -> bool:
    """Whether a job of the report has eval_generate scores: the table then has a `best eval score` column."""
    return any(job.scores for job in jobs)


def columns(jobs: list[JobMetrics]) -> list[str]:
    names = [*COLUMNS[:4], "best eval score", *COLUMNS[4:]] if _scored(jobs) else list(COLUMNS)
    return [*names, KEPT_COLUMN] if _kept_any(jobs) else names


def report_data(jobs: list[JobMetrics]) -> list[dict]:
    """The report's numbers per job, as `aspen report --json` prints them."""
    return [{"job": job.name, "folder": str(job.folder), "state": job.state, "steps": job.steps[-1] if job.steps else 0,
             "final_loss": job.final_loss, "best_eval_loss": job.best_eval, "best_eval_score": job.best_score,
             "kept": job.kept, "tokens": job.tokens,
             "losses": [{"step": s, "loss": loss} for s, loss in zip(job.steps, job.losses, strict=True)],
             "evals": [{"step": s, "eval_loss": loss, **({"eval_score": job.scores[s]} if s in job.scores else {})}
                       for s, loss in sorted(job.evals.items())]} for job in jobs]


def markdown_table(jobs: list[JobMetrics]) -> str:
    names = columns(jobs)
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(jobs)]
    return "\n".join(lines) + "\n"


def plot(jobs: list[JobMetrics], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(10, 6), dpi=100)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))   # whole steps, never 4.5
    for job in (job for job in jobs if job.steps or job.evals):   # one that never stepped: in the table only
        line, = axes.plot(job.steps, job.losses, label=f"{job.name} (train)", linewidth=1.5)
        if job.evals:
            steps = sorted(job.evals)
            axes.plot(steps, [job.evals[s] for s in steps], "o--", color=line.get_color(), markersize=5,
                      linewidth=1, label=f"{job.name} (eval)")
    axes.set_title(title)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.grid(True, alpha=0.3)
    if axes.lines:   # no job stepped yet: no curve to name
        axes.legend(fontsize="small", loc="upper right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(run_dir: Path | str, console=None) -> tuple[Path | StorageURI, Path | StorageURI]:
    """Write `report.png` and `report.md` into `run_dir` (uploaded, for a storage URI); print the table.
    Returns both paths."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    jobs = collect(run_dir)
    if is_uri(run_dir):
        uri = as_location(str(run_dir))
        with tempfile.TemporaryDirectory(prefix="aspen-report-") as folder:
            _write_files(jobs, Path(folder), uri.name, str(uri))
            location = StorageLocation(str(uri))
            for name in ("report.png", "report.md"):
                location.upload_file(Path(folder) / name, name)
        png, markdown = uri / "report.png", uri / "report.md"
    else:
        run_dir = Path(run_dir)
        _write_files(jobs, run_dir, run_dir.resolve().name, str(run_dir.resolve()))
        png, markdown = run_dir / "report.png", run_dir / "report.md"
    table = Table(title=escape(f"{len(jobs)} jobs in {run_dir}"))   # folders' names as they are, not markup
    for column in columns(jobs):
        table.add_column(column, justify="left" if column in ("job", "state", KEPT_COLUMN) else "right")
    for row in summary_rows(jobs):
        table.add_row(*map(escape, row))
    console = console or Console()
    console.print(table)
    console.print(f"loss curves in {png}, table in {markdown}", markup=False, highlight=False)
    return png, markdown


def _write_files(jobs: list[JobMetrics], folder: Path, name: str, where: str) -> None:
    plot(jobs, folder / "report.png", f"aspen: {len(jobs)} jobs in {name}")
    (folder / "report.md").write_text(f"# aspen report: {where}\n\n![loss curves](report.png)\n\n"
                                      + markdown_table(jobs))
