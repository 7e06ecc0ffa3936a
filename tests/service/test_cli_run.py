"""`aspen run jobs.yaml` end to end: adapters PEFT loads, metrics.jsonl and trainer.jsonl as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from actors.storage.gguf_cache import converted_source
from actors.storage.sources import resolve_source

NO_CLUSTER = Path(__file__).resolve().parents[1] / "helpers" / "cli_cluster_search.py"


def aspen(*args: str, cwd: Path, no_cluster: bool = False) -> subprocess.CompletedProcess:
    """`aspen ARGS`; with no_cluster as on a machine where Ray finds no running cluster (this test's workers run
    theirs beside each other: tests/helpers/cli_cluster_search.py)."""
    command = [str(NO_CLUSTER)] if no_cluster else ["-m", "orchestrator.cli"]
    return subprocess.run([sys.executable, *command, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def write_data(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "add.jsonl").open("w") as f:
        for i in range(24):
            f.write(json.dumps({"question": f"{i}+{i * 3}", "answer": str(i * 4)}) + "\n")
    (folder / "alpaca.json").write_text(json.dumps(
        [{"instruction": f"Repeat the word {w}", "input": "", "output": w} for w in ["cat", "dog", "sun", "sky"] * 5],
        indent=2))
    with (folder / "chat.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                             {"role": "assistant", "content": f"{i}"}]}) + "\n")


JOBS = """\
base_model: {base}
output_dir: out
step_tokens: 2048
jobs:
  - name: add
    data: data/add.jsonl
    format: {{type: prompt_response, prompt: "Add: {{question}}\\nAnswer:", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 4
    grad_accum: 2
    max_steps: {steps}
    eval_split: 4
  - name: alpaca
    data: data/alpaca.json
    format: {{type: alpaca}}
    lora: {{r: 8, alpha: 16, dropout: 0.05, target_modules: all-linear}}
    batch_size: 2
    max_steps: {steps}
    lr_schedule: cosine
  - name: chat
    data: data/chat.jsonl
    format: {{type: chat}}
    batch_size: 3
    epochs: 1
"""


def check_outputs(out: Path, steps: dict[str, int], base_folder: Path, gguf_file: str | None = None) -> None:
    trainer_rows = [json.loads(line) for line in (out / "trainer.jsonl").read_text().splitlines()]
    assert trainer_rows and all({"step", "jobs", "tokens", "padding_tokens", "seconds", "peak_memory_bytes"}
                                <= set(row) for row in trainer_rows)
    assert [row["step"] for row in trainer_rows] == list(range(1, len(trainer_rows) + 1))
    assert all(row["padding_tokens"] == 0 and row["peak_memory_bytes"] > 0 for row in trainer_rows)
    assert any(len(row["jobs"]) == 3 for row in trainer_rows), "the three jobs never shared a step"
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    reference = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32, **kwargs)
    for job, expected_steps in steps.items():
        rows = [json.loads(line) for line in (out / job / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, expected_steps + 1))
        assert all({"step", "loss", "tokens", "lr"} <= set(r) and r["tokens"] > 0 for r in rows)
        config = json.loads((out / job / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        model = PeftModel.from_pretrained(reference, out / job, adapter_name=job)
        assert any(f".lora_B.{job}." in name and p.abs().sum() > 0 for name, p in model.named_parameters()), \
            f"{job}: PEFT loaded no trained weights"
        reference = model.unload()


# Through the service the same jobs file runs in test_aspen_run_three_jobs_on_smollm2 (the real base);
# here the tiny model in-process, with the epoch's step count
@pytest.mark.parametrize("mode", [["--in-process"]], ids=["in-process"])
def test_aspen_run_on_a_tiny_model(tmp_path, tiny_model_dirs, mode):
    write_data(tmp_path / "data")
    (tmp_path / "jobs.yaml").write_text(JOBS.format(base=tiny_model_dirs["llama"], steps=3))
    result = aspen("run", *mode, "jobs.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "add" in result.stdout and "adapters and metrics in" in result.stdout
    # chat: 12 rows, batch 3, one epoch -> 4 optimizer steps
    check_outputs(tmp_path / "out", {"add": 3, "alpaca": 3, "chat": 4}, tiny_model_dirs["llama"])


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["service", "in-process"])
def test_malformed_row_stops_the_run_before_it_starts_with_file_line_and_field(tmp_path, tiny_model_dirs, mode):
    write_data(tmp_path / "data")
    with (tmp_path / "data" / "add.jsonl").open("a") as f:
        f.write(json.dumps({"question": "1+1", "answr": "2"}) + "\n")
    (tmp_path / "jobs.yaml").write_text(JOBS.format(base=tiny_model_dirs["llama"], steps=1))
    result = aspen("run", *mode, "jobs.yaml", cwd=tmp_path)
    # the rows are read before anything starts: a spec error (exit 2) naming file, line and field, no job trained
    assert result.returncode == 2, result.stderr
    assert "add.jsonl:25: field 'answer' is missing" in result.stderr
    assert "job 'add'" in result.stderr and "nothing was started" in result.stderr
    assert not any((tmp_path / "out").glob("*/adapter_model.safetensors")), "a job trained though a row was bad"


@pytest.mark.long   # 45 s on CI's machine of 2026-12-04: a run, then status and export from its folder
def test_after_a_run_ends_status_and_export_answer_from_its_folder(tmp_path, tiny_model_dirs, monkeypatch):
    """The next commands a user types once `aspen run` has ended (its service gone): `aspen status`, `aspen
    status JOB`, `aspen losses JOB` and `aspen export JOB` answer from the run's own job table, and say so; PEFT
    loads the export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ASPEN_RECENT_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    write_data(tmp_path / "data")
    (tmp_path / "jobs.yaml").write_text(JOBS.format(base=tiny_model_dirs["llama"], steps=2))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    ran = aspen("run", "jobs.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    # Ray's own token-auth notice is not the user's business: token authentication stays on, said explicitly
    assert "Token authentication is enabled" not in ran.stderr and "RAY_AUTH_MODE" not in ran.stderr
    # nor Ray's INFO lines about its cluster (they come with `aspen -v`)
    assert "Started a local Ray instance" not in ran.stdout + ran.stderr, ran.stderr
    elsewhere = tmp_path / "elsewhere"   # not the run's folder: found through the runs this machine started
    elsewhere.mkdir()
    # no cluster named, and none found here (the run's own cluster has gone; other tests' run beside this one)
    status = aspen("status", cwd=elsewhere, no_cluster=True)
    assert status.returncode == 0, status.stderr
    assert "no aspen service is running" in status.stderr and str(tmp_path / "out") in status.stderr
    assert all(name in status.stdout for name in ("add", "alpaca", "chat")) and "completed" in status.stdout
    one = aspen("status", "add", "--json", cwd=elsewhere, no_cluster=True)
    assert one.returncode == 0, one.stderr
    detail = json.loads(one.stdout)
    assert detail["state"] == "completed" and [h["state"] for h in detail["history"]][-1] == "completed"
    exported = aspen("export", "add", "--out", str(tmp_path / "add-peft"), cwd=elsewhere, no_cluster=True)
    assert exported.returncode == 0, exported.stderr
    assert "is a job of the run in" in exported.stderr
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    model = PeftModel.from_pretrained(base, tmp_path / "add-peft")
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    report = aspen("report", "--json", cwd=elsewhere, no_cluster=True)   # no folder given: the newest run's
    assert report.returncode == 0 and "the newest `aspen run`" in report.stderr, report.stderr
    assert {"add", "alpaca", "chat"} <= set(json.dumps(json.loads(report.stdout)).split('"'))
    gone = aspen("status", "--from", str(tmp_path / "nowhere"), cwd=elsewhere, no_cluster=True)
    assert gone.returncode == 2 and "no job table" in gone.stderr
    folder = aspen("status", str(tmp_path / "out"), cwd=elsewhere, no_cluster=True)   # the folder where a job goes
    assert folder.returncode == 2 and f"is a run's folder, not a job: give it as --from {tmp_path / 'out'}" in \
        folder.stderr, folder.stderr
    # the loss history, as the job's own metrics file has it (written beside its adapter, not from the table)
    losses = aspen("losses", "add", "--json", cwd=elsewhere, no_cluster=True)
    assert losses.returncode == 0 and "no aspen service is running" in losses.stderr, losses.stderr
    logged = [json.loads(line) for line in (tmp_path / "out" / "add" / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in json.loads(losses.stdout)] == \
        [(row["step"], row["loss"]) for row in logged if "loss" in row] != []


@pytest.mark.slow
@pytest.mark.long   # a minute or more: the real base loaded, warmed up and measured by a service of its own
def test_aspen_run_three_jobs_on_smollm2(tmp_path):
    write_data(tmp_path / "data")
    (tmp_path / "jobs.yaml").write_text(JOBS.format(base="smollm2-135m", steps=2).replace("epochs: 1", "max_steps: 2"))
    result = aspen("run", "jobs.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # the trainer's set-up is said as it happens, phase by phase, each once (the output is not a terminal),
    # before the jobs' own lines
    lines = result.stdout.splitlines()
    phases = [line for line in lines if line.startswith("trainer-0: ")]
    # (its load, from the GGUF's converted folder once a run made it, may take less than the display's poll: said
    # where seen, before the rest)
    shown = [p.split(" (")[0] for p in phases]
    assert shown[-2:] == ["trainer-0: warming up", "trainer-0: measuring a step's memory"], lines
    assert "trainer-0: loading smollm2-135m" not in shown or shown.index("trainer-0: loading smollm2-135m") == \
        len(shown) - 3, lines
    assert len(set(phases)) == len(phases)
    assert lines.index(phases[-1]) < min(i for i, line in enumerate(lines) if line.startswith("add: "))
    # PEFT loads the adapters onto the GGUF's converted folder (the run made it; parsing the GGUF again took
    # 17-30 s; tests/slow/test_smollm2.py checks that folder against the GGUF model)
    converted = converted_source(resolve_source("smollm2-135m"))
    check_outputs(tmp_path / "out", {"add": 2, "alpaca": 2, "chat": 2}, Path(converted.path))


@pytest.mark.long   # ~20 s: two runs of `aspen run` (make test-long)
def test_aspen_run_on_a_tiny_moe_model(tmp_path, tiny_tokenizer):
    """The same jobs file on a tiny Qwen3-MoE folder (a dense layer, experts elsewhere), the first job also adapting
    the expert stacks (`target_parameters`): every job trains, the adapters PEFT loads hold attention (on this type
    the dense MLP is not adapted: docs/models.md) and the first job's the experts, and a job naming an MLP layer
    is refused before it starts, saying why."""
    from tests.helpers.model_families import build_config, build_model
    from tests.helpers.models import VOCAB

    folder = tmp_path / "tiny-qwen3-moe"
    build_model(build_config("qwen3_moe", vocab_size=VOCAB, max_position_embeddings=512)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    write_data(tmp_path / "data")
    stacks = "target_parameters: [experts.gate_up_proj, experts.down_proj]"
    (tmp_path / "jobs.yaml").write_text(JOBS.format(base=folder, steps=3).replace(
        "target_modules: [q_proj, v_proj]}", f"target_modules: [q_proj, v_proj], {stacks}}}"))
    done = aspen("run", "--in-process", "jobs.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check_outputs(tmp_path / "out", {"add": 3, "alpaca": 3, "chat": 4}, folder)
    for job in ("add", "alpaca", "chat"):
        config = json.loads((tmp_path / "out" / job / "adapter_config.json").read_text())
        assert set(config["target_modules"]) <= {"q_proj", "k_proj", "v_proj", "o_proj"}, (job, config)
        assert sorted(config["target_parameters"] or []) == (
            ["experts.down_proj", "experts.gate_up_proj"] if job == "add" else []), job
    saved = load_file(tmp_path / "out" / "add" / "adapter_model.safetensors")
    stack = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
    assert saved[stack].abs().sum() > 0, "the experts adapter trained"
    mlp = JOBS.format(base=folder, steps=1).replace("[q_proj, v_proj]", "[q_proj, down_proj]")
    (tmp_path / "mlp.yaml").write_text(mlp.replace("output_dir: out", "output_dir: out-mlp"))
    refused = aspen("run", "--in-process", "mlp.yaml", cwd=tmp_path)   # before anything starts: no out-mlp
    assert refused.returncode == 2 and not (tmp_path / "out-mlp").exists(), refused.stderr[-2000:]
    assert ("mlp.yaml:8: job 'add' (jobs[0]), field lora.target_modules: down_proj: on a qwen3_moe base PEFT and vLLM "
            "read an adapter's layers of that name as its MoE experts'") in refused.stderr, refused.stderr[-2000:]
