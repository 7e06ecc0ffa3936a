"""The layers `lora.target_modules` is checked against before a job is entered (orchestrator/target_layers.py) are kept
per base and its files' identity (path, modification time, size): a base replaced on disk is read again, even where
the copy kept the old modification time (`cp -p`, `rsync -a`, an archive unpacked); a base that cannot be read is
read once per identity and said once (the file, what is wrong, what to do), and read again once the file is fixed;
the kept bases are bounded. The reference for the layers a replaced base has: its model built by transformers from
the new config (as its trainer lays it out)."""

from __future__ import annotations

import logging
import os

import pytest

from orchestrator import target_layers
from tests.helpers.gguf_files import converter_names, write_gguf
from tests.helpers.model_families import build_config


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ASPEN_CACHE_DIR", str(tmp_path / "cache"))
    tables = [getattr(target_layers, name, {}) for name in ("_KEPT", "_LOCKS", "_SAID")]
    for table in tables:
        table.clear()
    yield
    for table in tables:
        table.clear()


def transformers_layers(model_type: str) -> set[str]:
    """The linear layers of the model transformers builds from the model type's tiny config, laid out as loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.conv1d_layers import conv1d_as_linear

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(model_type))
    conv1d_as_linear(model)
    return {name.rsplit(".", 1)[-1] for name in linear_module_names(model)}


def replace_config(folder, model_type: str, *, keep_mtime: bool) -> None:
    """A new config.json written over the old one (no weights: the check builds the model from its config)."""
    config = folder / "config.json"
    before = config.stat() if config.exists() else None
    build_config(model_type).to_json_file(config)
    if keep_mtime and before is not None:   # as `cp -p`, `rsync -a` or an unpacked archive leave it
        os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert config.stat().st_mtime_ns == before.st_mtime_ns


def test_a_base_replaced_in_place_is_read_again(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    replace_config(base, "llama", keep_mtime=False)
    llama, gpt2 = transformers_layers("llama"), transformers_layers("gpt2")
    assert "q_proj" in llama and "c_attn" in gpt2 and "c_attn" not in llama
    found = target_layers.target_problems(str(base), ["q_proj", "c_attn"])
    assert found["q_proj"] is None and "'c_attn' matches no linear layer" in found["c_attn"]

    replace_config(base, "gpt2", keep_mtime=True)   # another architecture, its modification time kept
    found = target_layers.target_problems(str(base), ["q_proj", "c_attn"])
    assert found["c_attn"] is None, found
    assert "'q_proj' matches no linear layer" in found["q_proj"]
    assert all(name in found["q_proj"] for name in gpt2)   # the new base's layers, named

    replace_config(base, "qwen3_moe", keep_mtime=False)   # replaced as usual: a new modification time
    found = target_layers.target_problems(str(base), ["q_proj", "down_proj"])
    assert found["q_proj"] is None and "down_proj" in found["down_proj"]   # qwen3_moe leaves its mlp names alone


def test_a_gguf_file_replaced_in_place_is_read_again(tmp_path):
    """A GGUF file of another layer naming (phi3's fused qkv_proj) written over a Llama one, its time kept."""
    path = tmp_path / "base.gguf"
    for arch, model_type in (("llama", "llama"), ("phi3", "phi3")):
        before = path.stat() if path.exists() else None
        _, linear, dims = converter_names(arch, model_type)
        write_gguf(path, arch, build_config(model_type).num_hidden_layers, dims)
        if before is not None:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        found = target_layers.target_problems(str(path), ["q_proj", "qkv_proj"])
        short = {name.rsplit(".", 1)[-1] for name in linear}
        assert {target for target, problem in found.items() if problem is None} == {"q_proj", "qkv_proj"} & short


def test_the_kept_bases_are_bounded(tmp_path, monkeypatch):
    reads = []

    def read(base_model, source):
        reads.append(base_model)
        return target_layers.BaseLayers(("model.layers.0.self_attn.q_proj",), "llama")

    monkeypatch.setattr(target_layers, "_read_layers", read)
    bases = []
    for index in range(target_layers.KEPT_MAX + 5):
        base = tmp_path / f"base{index}"
        base.mkdir()
        (base / "config.json").write_text("{}")
        bases.append(str(base))
        assert target_layers.target_problems(str(base), ["q_proj"]) == {"q_proj": None}
    assert len(target_layers._KEPT) == target_layers.KEPT_MAX and len(target_layers._LOCKS) == target_layers.KEPT_MAX
    target_layers.target_problems(bases[-1], ["q_proj"])   # kept: not read again
    target_layers.target_problems(bases[0], ["q_proj"])    # the least recently asked was dropped: read again
    assert reads == [*bases, bases[0]]


def counted_runs(monkeypatch) -> list:
    """Each process the check starts to build a base's model (still started)."""
    runs = []
    real = target_layers.subprocess.run

    def run(*args, **kwargs):
        runs.append(args[0][-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(target_layers.subprocess, "run", run)
    return runs


def test_a_config_that_cannot_be_built_is_tried_once_said_once_and_read_again_once_fixed(tmp_path, monkeypatch,
                                                                                          caplog):
    base = tmp_path / "base"
    base.mkdir()
    config = build_config("llama").to_dict()
    (base / "config.json").write_text('{"model_type": "no_such_model_type", "hidden_size": 64}')
    runs = counted_runs(monkeypatch)
    with caplog.at_level(logging.INFO, logger="orchestrator.target_layers"):
        for _ in range(4):
            assert target_layers.target_problems(str(base), ["q_proj"]) is None   # left to its trainer
    assert runs == [str(base)]   # one process, not one per submission
    said = [record for record in caplog.records if record.name == "orchestrator.target_layers"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert str(base / "config.json") in said[0].message and "no_such_model_type" in said[0].message
    assert "fix or replace the base's config.json" in said[0].message

    import json
    (base / "config.json").write_text(json.dumps(config))   # fixed
    found = target_layers.target_problems(str(base), ["q_proj", "q_projj"])
    assert found["q_proj"] is None and "did you mean 'q_proj'" in found["q_projj"]
    assert len(runs) == 2


@pytest.mark.parametrize("damage", ["cut short", "not a GGUF file"])
def test_an_unreadable_gguf_file_is_read_once_and_said_once_and_read_again_once_fixed(tmp_path, monkeypatch, caplog,
                                                                                      damage):
    from actors.storage import gguf_header

    path = tmp_path / "base.gguf"
    _, _, dims = converter_names("llama", "llama")
    write_gguf(path, "llama", build_config("llama").num_hidden_layers, dims)
    good = path.read_bytes()
    path.write_bytes(good[:100] if damage == "cut short" else b"PK\x03\x04" + good[4:])
    reads = []
    real = gguf_header.read_header
    monkeypatch.setattr(gguf_header, "read_header", lambda file: reads.append(file) or real(file))
    runs = counted_runs(monkeypatch)
    with caplog.at_level(logging.INFO, logger="orchestrator.target_layers"):
        for _ in range(4):
            assert target_layers.target_problems(str(path), ["q_proj"]) is None   # left to its trainer
    assert len(reads) == 1 and runs == []
    said = [record.message for record in caplog.records if record.name == "orchestrator.target_layers"]
    assert len(said) == 1 and str(path) in said[0] and damage in said[0]
    assert "replace the file (download it again" in said[0]

    path.write_bytes(good)   # downloaded again
    found = target_layers.target_problems(str(path), ["q_proj", "q_projj"])
    assert found["q_proj"] is None and "did you mean 'q_proj'" in found["q_projj"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_a_config_it_may_not_read_is_read_again_once_permitted(tmp_path, caplog):
    base = tmp_path / "base"
    base.mkdir()
    replace_config(base, "llama", keep_mtime=False)
    os.chmod(base / "config.json", 0)
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.target_layers"):
            assert target_layers.target_problems(str(base), ["q_proj"]) is None
        assert str(base / "config.json") in caplog.text and "ermission" in caplog.text
    finally:
        os.chmod(base / "config.json", 0o644)   # the same modification time: its status change time differs
    assert target_layers.target_problems(str(base), ["q_proj"]) == {"q_proj": None}


def test_a_gguf_architecture_aspen_does_not_train_is_refused_at_submit(tmp_path):
    """transformers converts a bloom GGUF file, but aspen trains no bloom model (its trainer would refuse it once
    loaded): `aspen submit`'s check says so, naming the architecture and those aspen trains, for the file's line."""
    from actors.engine.model_support import SUPPORTED
    from actors.spec.run_spec import RunSpec
    from orchestrator import base_check
    from orchestrator.jobs_file import SpecError

    assert "bloom" not in SUPPORTED
    path = tmp_path / "bloom.gguf"
    write_gguf(path, "bloom", 2, {"token_embd": 2, "blk.0.attn_qkv": 2, "blk.1.attn_qkv": 2})
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"base_model: {path}\njobs:\n  - name: a\n    data: d.jsonl\n    format: text\n"
                    "    lora: {target_modules: [query_key_value]}\n")
    spec = RunSpec.model_validate({"base_model": str(path), "jobs": [
        {"name": "a", "data": "d.jsonl", "format": "text", "lora": {"target_modules": ["query_key_value"]}}]})
    with pytest.raises(SpecError) as refused:
        base_check.check_target_modules(spec, jobs, verb="submit")
    said = str(refused.value)
    assert f"{jobs}:6" in said and "architecture 'bloom'" in said and "llama, qwen2" in said and "phi3" in said
    assert "nothing was submitted" in said



def test_a_hub_id_is_checked_and_one_downloaded_again_read_again(tmp_path, monkeypatch):
    """A hub id in the local Hugging Face cache (laid out as the hub's client writes it: a snapshot per revision,
    refs/main naming the current one) is checked against its model's layers (it was not checked at all: its
    config was looked for under the working directory); downloaded again as another model (a new revision), the
    check follows the new one."""
    import huggingface_hub.constants

    from tests.helpers.hub import offline

    cache = tmp_path / "hub"
    repo = cache / "models--aspen-tests--tiny-base"
    (repo / "refs").mkdir(parents=True)
    offline(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))   # the process that builds the model reads it at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for revision, model_type, has, lacks in (("a" * 40, "llama", "q_proj", "c_attn"), ("b" * 40, "gpt2", "c_attn",
                                                                                      "q_proj")):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        replace_config(snapshot, model_type, keep_mtime=False)
        (repo / "refs" / "main").write_text(revision)
        assert has in transformers_layers(model_type) and lacks not in transformers_layers(model_type)
        found = target_layers.target_problems("aspen-tests/tiny-base", [has, lacks])
        assert found is not None and found[has] is None and f"'{lacks}' matches no linear layer" in found[lacks]


def test_a_missing_base_is_said_once_and_checked_once_it_is_there(tmp_path, caplog):
    """A base this machine does not have (it may be on the trainers' machines) is left to its trainer and said once
    (naming the file), not on every submission; once there, it is checked."""
    path = tmp_path / "later.gguf"
    with caplog.at_level(logging.INFO, logger="orchestrator.target_layers"):
        for _ in range(3):
            assert target_layers.target_problems(str(path), ["q_proj"]) is None
    said = [record.message for record in caplog.records if record.name == "orchestrator.target_layers"]
    assert len(said) == 1 and f"GGUF file {path} does not exist" in said[0], said
    _, _, dims = converter_names("llama", "llama")
    write_gguf(path, "llama", build_config("llama").num_hidden_layers, dims)
    found = target_layers.target_problems(str(path), ["q_proj", "q_projj"])
    assert found["q_proj"] is None and "did you mean 'q_proj'" in found["q_projj"]


def test_all_linear_on_a_gguf_architecture_aspen_does_not_train_is_refused_at_submit_at_its_line(tmp_path):
    """`target_modules: all-linear` on a bloom GGUF file: accepted (only list-form names were checked), then failed on
    its trainer; now refused as a list is, at the field's line, naming the architecture. The reference that aspen
    trains no bloom: its supported model types; and the same job on a llama GGUF file is not refused."""
    from actors.engine.model_support import SUPPORTED
    from actors.spec.run_spec import RunSpec
    from orchestrator import base_check
    from orchestrator.jobs_file import SpecError

    assert "bloom" not in SUPPORTED and "llama" in SUPPORTED
    bloom, llama = tmp_path / "bloom.gguf", tmp_path / "llama.gguf"
    write_gguf(bloom, "bloom", 2, {"token_embd": 2, "blk.0.attn_qkv": 2, "blk.1.attn_qkv": 2})
    _, _, dims = converter_names("llama", "llama")
    write_gguf(llama, "llama", build_config("llama").num_hidden_layers, dims)
    for path, refused in ((bloom, True), (llama, False)):
        jobs = tmp_path / "jobs.yaml"
        jobs.write_text(f"base_model: {path}\njobs:\n  - name: a\n    data: d.jsonl\n    format: text\n"
                        "    lora:\n      r: 4\n      target_modules: all-linear\n")
        spec = RunSpec.model_validate({"base_model": str(path), "jobs": [
            {"name": "a", "data": "d.jsonl", "format": "text", "lora": {"r": 4, "target_modules": "all-linear"}}]})
        if not refused:
            base_check.check_target_modules(spec, jobs)
            continue
        with pytest.raises(SpecError) as said:
            base_check.check_target_modules(spec, jobs, verb="submit")
        assert f"{jobs}:8: job 'a' (jobs[0]), field lora.target_modules: " in str(said.value), said.value
        assert "architecture 'bloom'" in str(said.value) and "nothing was submitted" in str(said.value)


def test_a_base_whose_model_build_timed_out_is_read_again_at_the_next_submission(tmp_path, monkeypatch):
    """The model built on meta past `CHECK_TIMEOUT_S` (a busy machine): the check was left to the trainer, and that
    was kept until the base's files changed, for every later submission; now it is read again the next time, and
    gives the names transformers' own model of the config has."""
    base = tmp_path / "base"
    base.mkdir()
    replace_config(base, "gpt2", keep_mtime=False)
    runs = counted_runs(monkeypatch)
    monkeypatch.setattr(target_layers, "CHECK_TIMEOUT_S", 0.01)
    assert target_layers.target_problems(str(base), ["c_attn", "q_proj"]) is None   # timed out: left to its trainer
    monkeypatch.setattr(target_layers, "CHECK_TIMEOUT_S", 600)
    found = target_layers.target_problems(str(base), ["c_attn", "q_proj"])
    assert "c_attn" in transformers_layers("gpt2") and "q_proj" not in transformers_layers("gpt2")
    assert found is not None and found["c_attn"] is None and "'q_proj' matches no linear layer" in found["q_proj"]
    assert len(runs) == 2
    assert target_layers.target_problems(str(base), ["c_attn"]) == {"c_attn": None} and len(runs) == 2   # kept now


@pytest.mark.parametrize("arch", ["olmo", "bloom"])
def test_a_gguf_architecture_aspen_does_not_train_is_refused_with_a_converted_folder_too(tmp_path, arch):
    """A GGUF file of an architecture transformers does not convert (olmo: not among its GGUF architectures) or
    aspen does not train (bloom), beside a converted folder (safetensors and a config.json, as a trainer of another
    aspen or by hand left it): its names were found in the folder's safetensors headers, the quick path, and taken;
    now refused as without the folder (the reference: the same check before the folder was there)."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from actors.engine.model_support import SUPPORTED
    from actors.spec.run_spec import RunSpec
    from actors.storage.sources import cache_root, converted_folder_path, resolve_source
    from orchestrator import base_check
    from orchestrator.jobs_file import SpecError

    assert (arch not in SUPPORTED and arch in GGUF_SUPPORTED_ARCHITECTURES if arch == "bloom"
            else arch not in GGUF_SUPPORTED_ARCHITECTURES)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, 2, {"token_embd": 2, "blk.0.attn_qkv": 2, "blk.1.attn_qkv": 2})
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"base_model: {path}\njobs:\n  - name: a\n    data: d.jsonl\n    format: text\n"
                    "    lora: {target_modules: [query_key_value]}\n")
    spec = RunSpec.model_validate({"base_model": str(path), "jobs": [
        {"name": "a", "data": "d.jsonl", "format": "text", "lora": {"target_modules": ["query_key_value"]}}]})

    def refusal() -> str | None:
        for table in (target_layers._KEPT, target_layers._LOCKS, target_layers._SAID):
            table.clear()
        try:
            base_check.check_target_modules(spec, jobs, verb="submit")
        except SpecError as error:
            return str(error)
        return None

    without = refusal()
    assert without is not None and f"architecture '{arch}'" in without and f"{jobs}:6" in without, without
    folder = converted_folder_path(resolve_source(str(path)), cache_root())
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": arch, "num_hidden_layers": 2}))
    save_file({f"transformer.h.{block}.self_attention.query_key_value.weight": torch.zeros(4, 4)
               for block in range(2)}, str(folder / "model.safetensors"))
    assert refusal() == without
