"""Unknown fields and format types in a jobs file are refused with the close names a user most likely meant ("did
you mean"), at their file:line, with the spec reference named; a field with no close name gets none."""

from __future__ import annotations

import pytest

from orchestrator.jobs_file import SpecError, parse_run_spec

TEXT = """\
output_dir: out
jobs:
  - name: a
    data: data.jsonl
    max_step: 3
    lora: {rank: 8, alpah: 16}
    format: {type: alpacca}
  - name: b
    data: data.jsonl
    learning_rate: 1.0e-3
    flavour: mint
    format: {type: prompt_response, promt: "Q: {question}", response: " {answer}"}
"""


def test_unknown_fields_and_tags_get_a_did_you_mean(tmp_path):
    import yaml

    with pytest.raises(SpecError) as refused:
        parse_run_spec(yaml.safe_load(TEXT), source="jobs.yaml", base_dir=tmp_path, text=TEXT, check_files=False)
    lines = str(refused.value).splitlines()

    def line_of(part: str) -> str:
        return next(line for line in lines if part in line)

    assert line_of("max_step:").startswith("jobs.yaml:5:") and "did you mean `max_steps`" in line_of("max_step:")
    assert "field lora.rank: unknown field; did you mean `r`?" in line_of("lora.rank")
    assert "did you mean `alpha`?" in line_of("lora.alpah")
    assert "format type 'alpacca' is not one of alpaca, prompt_response" in line_of("alpacca")
    assert "did you mean `alpaca`?" in line_of("alpacca")
    assert "did you mean `prompt`?" in line_of("format.promt")
    assert "did you mean `lr`?" in line_of("learning_rate")
    assert "did you mean" not in line_of("flavour") and "docs/spec.md" in line_of("flavour")


def test_a_format_named_by_its_type_alone_is_that_format_with_its_defaults(tmp_path):
    """`format: alpaca` reads as `format: {type: alpaca}`; a type that needs fields (prompt_response) is refused for
    each field it lacks, and a misspelt one still gets its did-you-mean."""
    import yaml

    def job_format(value: str):
        text = f"output_dir: out\njobs:\n  - name: a\n    data: data.jsonl\n    format: {value}\n"
        spec = parse_run_spec(yaml.safe_load(text), source="jobs.yaml", base_dir=tmp_path, text=text, check_files=False)
        return spec.jobs[0].format

    assert job_format("alpaca") == job_format("{type: alpaca}")
    assert job_format("chat") == job_format("{type: chat}") and job_format("chat").messages_field == "messages"
    with pytest.raises(SpecError) as refused:
        job_format("prompt_response")
    assert "jobs.yaml:5:" in str(refused.value) and "field format.prompt: Field required" in str(refused.value)
    assert "field format.response: Field required" in str(refused.value)
    with pytest.raises(SpecError) as refused:
        job_format("alpacca")
    assert "format type 'alpacca' is not one of alpaca" in str(refused.value) and "did you mean `alpaca`?" in str(
        refused.value)


def test_a_name_aspen_cannot_use_is_refused_in_words_not_its_pattern(tmp_path):
    import yaml

    from actors.spec.job_spec import JobSpec

    text = "jobs:\n  - name: my job/1\n    data: data.jsonl\n"
    with pytest.raises(SpecError) as refused:
        parse_run_spec(yaml.safe_load(text), source="jobs.yaml", base_dir=tmp_path, text=text, check_files=False)
    assert str(refused.value) == ("jobs.yaml:2: job 'my job/1' (jobs[0]), field name: 'my job/1' is not a name aspen "
                                  "takes: 1 to 64 letters, digits, '_' or '-', the first a letter or digit (it names "
                                  "a folder and an MQTT topic level: no spaces, '/', '.', '+' or '#')")
    # the words say what the pattern does: a name they allow is taken, one they forbid refused
    for good, bad in (("a" * 64, "a" * 65), ("9-lives_", "-lead"), ("x", "x.y")):
        JobSpec(name=good, data="d.jsonl", format="text")
        with pytest.raises(ValueError):
            JobSpec(name=bad, data="d.jsonl", format="text")
