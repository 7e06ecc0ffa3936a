"""The memory probe's figures kept between trainer starts (actors/engine/probe_cache.py): a second start on the same
model and setting reads the figures the first one measured, without a probe step; another setting, model shape or
engine code measures again; a damaged file is said, measured again and replaced; a folder that refuses the write is
said and the figures still come back; `ASPEN_CACHE_DIR=off` keeps nothing."""

from __future__ import annotations

import json
import logging

import pytest

import actors.engine.probe_cache as probe_cache
from actors.engine.memory_prior import probe_base_activation
from actors.engine.models import from_module
from tests.helpers.models import tiny_model


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """The probe steps run here, counted: each call a measurement."""
    calls: list[dict] = []

    def counted(base, **kwargs):
        calls.append(kwargs)
        return probe_base_activation(base, **kwargs)

    monkeypatch.setattr(probe_cache, "probe_base_activation", counted)
    monkeypatch.setenv("ASPEN_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def kept_files(tmp_path):
    return sorted((tmp_path / "cache" / "memory-probes").glob("*.json"))


def test_a_second_start_reads_the_first_ones_figures_and_another_setting_measures(probes, tmp_path):
    first = probe_cache.cached_probe(from_module(tiny_model("llama"), None))
    assert len(probes) == 1 and len(kept_files(tmp_path)) == 1
    # another model of the same shape (other weights, as another start loads it): the same figures, no probe step
    again = probe_cache.cached_probe(from_module(tiny_model("llama", seed=5), None))
    assert len(probes) == 1 and again == first
    assert isinstance(again.input_groups["no_grad"], frozenset)
    # what the figures depend on, changed one at a time: measured again, each kept beside the others
    probe_cache.cached_probe(from_module(tiny_model("llama"), None), recompute="layers")
    probe_cache.cached_probe(from_module(tiny_model("qwen2"), None))
    assert len(probes) == 3 and len(kept_files(tmp_path)) == 3


def test_a_change_to_the_engine_code_measures_again(probes, tmp_path, monkeypatch):
    probe_cache.cached_probe(from_module(tiny_model("llama"), None))
    monkeypatch.setattr(probe_cache, "engine_code_digest", lambda: "another aspen")
    probe_cache.cached_probe(from_module(tiny_model("llama"), None))
    assert len(probes) == 2 and len(kept_files(tmp_path)) == 2


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],                                           # cut short (a crash mid-write)
    lambda text: text.replace('"layers": 2', '"layers": "two"'),                    # a field of another type
    lambda text: json.dumps({**json.loads(text), "key": {"model": "another"}}),     # another model's figures
])
def test_a_damaged_file_is_said_measured_again_and_replaced(probes, tmp_path, caplog, damage):
    base = from_module(tiny_model("llama"), None)
    measured = probe_cache.cached_probe(base)
    (path,) = kept_files(tmp_path)
    path.write_text(damage(path.read_text()))
    with caplog.at_level(logging.WARNING, logger=probe_cache.__name__):
        again = probe_cache.cached_probe(base)
    assert len(probes) == 2 and again.layers == measured.layers
    assert str(path) in caplog.text and "measuring them again" in caplog.text
    caplog.clear()
    probe_cache.cached_probe(base)     # the file was replaced: read without a word, nothing measured
    assert len(probes) == 2 and caplog.text == ""


def test_a_folder_that_refuses_the_write_is_said_and_the_figures_still_come(probes, tmp_path, monkeypatch, caplog):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger=probe_cache.__name__):
        activation = probe_cache.cached_probe(from_module(tiny_model("llama"), None))
    assert activation.per_token > 0 and len(probes) == 1
    assert "could not be kept" in caplog.text and "ASPEN_CACHE_DIR" in caplog.text


def test_cache_off_keeps_nothing(probes, tmp_path, monkeypatch):
    monkeypatch.setenv("ASPEN_CACHE_DIR", "off")
    for _ in range(2):
        probe_cache.cached_probe(from_module(tiny_model("llama"), None))
    assert len(probes) == 2 and not (tmp_path / "cache").exists()
