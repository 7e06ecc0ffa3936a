"""Spec texts built to make a parser run for minutes or build a structure without end, read as the HTTP API
reads a body (`http.request_bodies.parse_body`) and as `aspen run` reads a jobs file (`jobs_file.load_run_spec`):
a million nested brackets, a "billion laughs" of aliases, an alias at the end of a megabyte, more values than
any job spec has. Each is refused naming the limit and, where the parser knows it, the line; what the limits
let through is the data PyYAML's own `yaml.safe_load` (or `json.loads`) gives, the reference. The limits hold
on PyYAML's pure-Python parser too (a PyYAML built without libyaml), whose slowness the time limit bounds.
The server-side timings (answered in under a second while other requests are answered) are in
tests/servers/test_http_api.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from orchestrator.http.request_bodies import BODY_LIMITS, Refused, parse_body
from orchestrator.jobs_file import SpecError, load_run_spec
from orchestrator.spec_text import TextLimits, TooComplex, check_yaml, load_json, load_yaml

JOBS = """\
base_model: smollm2-135m
jobs:
  - &first
    name: a
    data: data.jsonl
    format: {type: prompt_response, prompt: "{q}", response: " {a}"}
    lora: {r: 4, target_modules: [q_proj, v_proj]}
    max_steps: 5
  - <<: *first
    name: b
    lr: 2.0e-4
"""


def laughs(levels: int) -> str:
    """Each alias list stands for ten of the one before: `levels` levels stand for 10**levels strings."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\njobs: []\n"


def nested(depth: int, closed: bool = True) -> str:
    return "[" * depth + ("]" * depth if closed else "")


LATE_ALIAS = "padding: '" + "p" * 1_000_000 + "'\nfirst: &x 1\nsecond: *x\n"
MANY_VALUES = "\n".join(f"k{i}: v{i}" for i in range(70_000)) + "\nfirst: &x 1\nsecond: *x\n"


# -- what the HTTP API takes: no anchors, 30 000 values, 32 deep ----------------------------------------------
@pytest.mark.parametrize("body, media, status, kind, phrase", [
    (nested(1_000_000, closed=False), "application/yaml", 422, "too_deep", "nested too deeply"),
    (nested(1_000_000, closed=False), "application/json", 422, "too_deep", "nested too deeply"),
    (nested(33), "application/yaml", 422, "too_deep", "nested more than 32 deep"),
    (nested(33), "application/json", 422, "too_deep", "nested more than 32 deep"),
    (LATE_ALIAS, "application/yaml", 422, "yaml_alias", "anchors and aliases"),
    (laughs(9), "application/yaml", 422, "yaml_alias", "anchors and aliases"),
    (MANY_VALUES, "application/yaml", 413, "too_many_values", "more than 30000 values"),
    (json.dumps({f"k{i}": i for i in range(20_000)}), "application/json", 413, "too_many_values",
     "more than 30000 values"),
    ("name: [x\n", "application/yaml", 422, "yaml_invalid", "malformed YAML"),
])
def test_a_hostile_body_is_refused_naming_the_limit(body, media, status, kind, phrase):
    with pytest.raises(Refused) as refused:
        parse_body(body.encode(), media)
    assert refused.value.status == status, refused.value
    assert phrase in refused.value.detail, refused.value.detail
    (error,) = refused.value.errors
    assert error["type"] == kind and error["loc"] == ["body"], error
    if media == "application/yaml":
        assert error["line"] >= 1 and error["column"] >= 1, error   # where the reader stopped
    if kind == "yaml_alias" and body is LATE_ALIAS:
        assert error["line"] == 2, error                                # the anchor, after the megabyte


def test_a_body_within_the_limits_is_what_pyyaml_and_json_read(tmp_path):
    plain = JOBS.replace("  - &first\n", "  -\n").replace("  - <<: *first\n", "  - data: data.jsonl\n"
                                                                             "    format: {type: alpaca}\n")
    data, text = parse_body(plain.encode(), "application/yaml")
    assert data == yaml.safe_load(plain) and text == plain
    at_the_limit = nested(32)
    assert parse_body(at_the_limit.encode(), "application/json")[0] == json.loads(at_the_limit)
    assert parse_body(at_the_limit.encode(), "application/yaml")[0] == yaml.safe_load(at_the_limit)
    body = {f"k{i}": i for i in range(BODY_LIMITS.values // 2 - 1)}   # keys and values: just under the limit
    assert parse_body(json.dumps(body).encode(), "application/json")[0] == body


# -- a jobs file: the user's own, aliases welcome, within bounds ---------------------------------------------------
def test_a_jobs_file_with_anchors_and_merge_keys_reads_as_pyyaml_reads_it(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"question": "1+1", "a": "2"}\n')
    (tmp_path / "jobs.yaml").write_text(JOBS)
    spec = load_run_spec(tmp_path / "jobs.yaml")
    reference = yaml.safe_load(JOBS)["jobs"]
    assert [job.name for job in spec.jobs] == [job["name"] for job in reference] == ["a", "b"]
    assert spec.jobs[1].lr == reference[1]["lr"] and spec.jobs[1].max_steps == reference[0]["max_steps"]
    assert spec.jobs[1].lora.r == 4 and spec.jobs[1].data == tmp_path / "data.jsonl"


@pytest.mark.parametrize("text, phrase, line", [
    (laughs(12), "more than 1000000 values (aliases counted as what they stand for)", 6),
    ("base_model: m\njobs: " + nested(200_000, closed=False) + "\n", "nested more than 32 deep", 2),
])
def test_a_jobs_file_beyond_the_limits_is_one_message_with_its_line(tmp_path, text, phrase, line):
    (tmp_path / "jobs.yaml").write_text(text)
    with pytest.raises(SpecError) as refused:
        load_run_spec(tmp_path / "jobs.yaml")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'jobs.yaml'}:{line}: ") and phrase in message, message
    assert "\n" not in message


def test_aliases_count_as_what_they_stand_for():
    limits = TextLimits(values=1000)
    assert load_yaml(laughs(2), limits) == yaml.safe_load(laughs(2))     # 10 + 100 strings: within
    with pytest.raises(TooComplex, match="more than 1000 values"):
        load_yaml(laughs(3), limits)                                       # 1 000 more: beyond


# -- without libyaml, and the time limit ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind", [(nested(100_000, closed=False), "too_deep"), (laughs(9), "yaml_alias"),
                                        (MANY_VALUES, "too_many_values")])
def test_the_limits_hold_on_pyyaml_without_libyaml(text, kind):
    with pytest.raises(TooComplex) as refused:
        check_yaml(text, dataclasses.replace(BODY_LIMITS, seconds=None), loader=yaml.SafeLoader)
    assert refused.value.kind == kind and refused.value.line is not None, refused.value


def test_a_text_not_read_within_its_time_is_refused():
    text = "\n".join(f"k{i}: v{i}" for i in range(5_000))
    assert load_yaml(text, TextLimits(seconds=60)) == yaml.safe_load(text)
    with pytest.raises(TooComplex) as refused:
        check_yaml(text, TextLimits(seconds=1e-9))
    assert refused.value.kind == "too_slow" and "not read within 1e-09 s" in str(refused.value)


def test_json_is_checked_as_yaml_is():
    with pytest.raises(TooComplex, match="nested more than 4 deep"):
        load_json(json.dumps({"a": {"b": {"c": {"d": {"e": 1}}}}}), TextLimits(depth=4))
    assert load_json('{"a": {"b": [1, 2]}}', TextLimits(depth=3)) == {"a": {"b": [1, 2]}}
