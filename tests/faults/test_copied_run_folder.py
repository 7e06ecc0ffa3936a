"""`aspen run` on a run folder copied (`cp -r out out2`) or whose job table was deleted: its job folders hold the
adapters, checkpoints and metrics of a run the table has no record of there, and the same jobs file trained a new
job over each, silently. Now the run is refused before anything is loaded or deleted (exit 2, in-process and through
a service, Ray never started), naming each job, what its folder holds (whose, at which step) and what to do;
`--overwrite` then starts them over there, the original folder untouched. A folder holding other files only trains
as before."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.interrupted_runs import NO_RAY, write_run

STEPS = 4


def aspen_run(folder: Path, *args: str, env: dict[str, str] | None = NO_RAY) -> subprocess.CompletedProcess:
    """`aspen run jobs.yaml ARGS`; by default where no Ray cluster answers (a run that needed one fails)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--quiet", "jobs.yaml", *args],
                          cwd=folder, capture_output=True, text=True, timeout=300, env=env)


def digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and ".aspen" not in path.parts}


@pytest.mark.long
def test_a_copied_or_tableless_run_folder_is_refused_then_overwritten_only_when_asked(tmp_path, tiny_model_dirs):
    write_run(tmp_path, tiny_model_dirs["llama"], steps=STEPS, every=2)
    done = aspen_run(tmp_path, "--in-process")
    assert done.returncode == 0, done.stderr
    shutil.copytree(tmp_path / "out", tmp_path / "out2")
    copy = digests(tmp_path / "out2")
    out2 = (tmp_path / "out2").resolve()

    for mode in (("--in-process",), ()):   # in this process, and through a service (refused before Ray starts)
        refused = aspen_run(tmp_path, "--output-dir", "out2", *mode)
        assert refused.returncode == 2, (mode, refused.stdout, refused.stderr)
        err = refused.stderr
        assert f"the job folders of {out2} hold the outputs of a run whose jobs its job table" in err, err
        for name in ("first", "second"):
            assert (f"job '{name}': {out2 / name} holds job '{name}' at step {STEPS}: its adapter (aspen.json), a "
                    f"checkpoint at step {STEPS}, metrics.jsonl ({STEPS} rows); last written ") in err, err
            assert (f"its table records job '{name}' in {(tmp_path / 'out').resolve() / name}: a run with output_dir "
                    f"{(tmp_path / 'out').resolve()} resumes it or leaves it alone there") in err, err
        assert ("give this run another output_dir (--output-dir), or run with --overwrite to delete those outputs and "
                "start 'first', 'second' over there") in err, err
        assert "Traceback" not in err and digests(tmp_path / "out2") == copy

    # the table deleted: the jobs' folders are no record of its own either
    shutil.rmtree(tmp_path / "out2/.aspen")
    refused = aspen_run(tmp_path, "--output-dir", "out2")
    assert refused.returncode == 2 and f"job 'first': {out2 / 'first'} holds job 'first'" in refused.stderr
    assert "its table records" not in refused.stderr and digests(tmp_path / "out2") == copy

    # asked for: started over there, in this process and through a service (which refuses a folder holding outputs
    # no job of its table wrote: the run deletes them first), the original run's folder as it was
    original = digests(tmp_path / "out")
    shutil.copytree(tmp_path / "out", tmp_path / "out4")
    for folder, mode, env in (("out2", (), None), ("out4", ("--in-process",), NO_RAY)):
        started = time.time()
        over = aspen_run(tmp_path, "--output-dir", folder, "--overwrite", *mode, env=env)
        assert over.returncode == 0, (mode, over.stdout, over.stderr)
        assert (f"first: started over (--overwrite): {(tmp_path / folder).resolve() / 'first'} held outputs its table "
                "has no record of") in over.stdout, over.stdout
        for name in ("first", "second"):   # trained again by this run: its own rows, one per step
            metrics = tmp_path / folder / name / "metrics.jsonl"
            assert len(metrics.read_text().splitlines()) == STEPS and metrics.stat().st_mtime >= started - 1
    assert digests(tmp_path / "out") == original

    # a run folder whose job folders hold other files only: trained as before
    for name in ("first", "second"):
        (tmp_path / "out3" / name).mkdir(parents=True)
        (tmp_path / "out3" / name / "notes.txt").write_text("mine\n")
    fresh = aspen_run(tmp_path, "--output-dir", "out3", "--in-process")
    assert fresh.returncode == 0, fresh.stderr
    assert (tmp_path / "out3/first/adapter_model.safetensors").is_file()
