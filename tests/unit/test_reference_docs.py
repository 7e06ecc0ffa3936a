"""The generated docs are current: `docs/spec.md` says what the models accept, `docs/architecture.md` lists
every module that exists. Regenerate both with `python -m orchestrator.reference_docs`."""

from __future__ import annotations

import re

import pytest

from actors.spec.job_spec import JobSpec
from actors.spec.run_spec import RunSpec
from orchestrator.reference_docs import GENERATED, REPO, render


@pytest.mark.parametrize("relative", sorted(GENERATED))
def test_generated_docs_are_current(relative):
    written = (REPO / relative).read_text()
    assert written == GENERATED[relative](), (f"{relative} is out of date: run `python -m "
                                              "orchestrator.reference_docs` and commit the result")


def test_the_spec_reference_names_every_field_with_its_range():
    text = render()
    for model in (RunSpec, JobSpec):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name
    assert "| `priority` | int | `0` | between -100 and 100 |" in text
    assert "| `seed` | int | `0` | at least 0 and less than 2**63 |" in text
    assert "| `lr` | float | `0.0003` | greater than 0 and at most 10 |" in text


def test_every_link_of_the_spec_reference_has_its_section():
    """A field whose type is a model links to that model's table (`[GrpoConfig](#grpoconfig)`): each such table
    is on the page, though no section lists its model (a model a listed one uses is shown after it)."""
    text = render()
    headings = {line.removeprefix("### ").lower() for line in text.splitlines() if line.startswith("### ")}
    links = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", text))
    assert {"grpoconfig", "generationeval", "loraconfig"} <= links
    assert links <= headings, sorted(links - headings)


def test_the_floor_plan_lists_every_module():
    plan = (REPO / "docs/architecture.md").read_text()
    for folder in ("orchestrator", "actors", "policies"):
        for module in (REPO / folder).rglob("*.py"):
            if module.name != "__init__.py":
                assert f"| `{module.name}` |" in plan or f"/{module.name}` |" in plan, module


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_manuals_links_reach_a_file_and_a_heading_that_exist():
    """Every relative link of the README and docs/ names a file that exists and, where it has an anchor, a
    heading of that page (a renamed heading would leave a dead link behind)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors = {page: {_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}
               for page in pages}
    dead, checked = [], 0
    for page in pages:
        for link, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            target = (page.parent / link).resolve() if link else page
            checked += 1
            if not target.exists():
                dead.append(f"{page.name}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in anchors.get(target, set()):
                dead.append(f"{page.name}: {link}#{anchor}")
    assert checked > 100 and not dead, dead
