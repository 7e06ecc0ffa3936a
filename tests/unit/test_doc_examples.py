"""The jobs files the README and docs/ show whole (every job with its data and format) are taken as written: each
YAML block with `jobs:` (or a list of jobs) is parsed as a jobs file is (orchestrator.jobs_file.parse_run_spec, data
files not looked for). A block that shows only some fields of a job (no `data:`) is a fragment and is skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.jobs_file import parse_run_spec

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def whole_examples() -> list[tuple[str, str]]:
    """(file:line, the block as a jobs file) of every block whose jobs all name their data."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            block = match.group(1)
            source = "jobs:\n" + block if block.lstrip().startswith("- name:") else block
            data = yaml.safe_load(source)
            jobs = data.get("jobs") if isinstance(data, dict) else None
            if isinstance(jobs, list) and jobs and all(isinstance(job, dict) and "data" in job for job in jobs):
                line = text[:match.start()].count("\n") + 2
                found.append((f"{path.relative_to(REPO)}:{line}", source))
    return found


EXAMPLES = whole_examples()


def test_the_docs_show_whole_jobs_files():
    assert len(EXAMPLES) >= 4, EXAMPLES   # the README's, data.md's and methods.md's (SFT on pairs, GRPO, ...)


@pytest.mark.parametrize("where, source", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_a_whole_jobs_file_in_the_docs_is_taken_as_written(where, source):
    spec = parse_run_spec(yaml.safe_load(source), source=where, text=source, check_files=False)
    assert spec.jobs
