"""A job started from another job's adapter (`init_adapter`) on a trainer loop, as the service starts it: it starts
at that adapter (trained at a learning rate too small to move it, it ends within Adam's bound of it); a copy cut
short fails its own job at the start with what to do, and the other job goes on; resumed from a checkpoint of its
own, the job continues from that, even with the saved adapter gone. Submissions: a user's adapter is read only
under their data roots or their own outputs, and one that does not fit the job is refused before it is entered."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.local_run import train_locally
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.saved_adapter import WEIGHTS_NAME
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle

LR = 1e-7
BETA1, BETA2 = 0.9, 0.999   # torch's AdamW defaults, which aspen's jobs use


def test_a_job_starts_from_another_jobs_adapter_and_resumes_from_its_own_checkpoint(tmp_path, tiny_base,
                                                                                    tiny_model_dirs):
    data = tmp_path / "data"
    first = job_dict("first", write_task_data(data, "first"), 6, lr=1e-2)
    train_locally(run_spec(str(tiny_model_dirs["llama"]), tmp_path / "before", [first]), base=tiny_base,
                  progress=False)
    saved = tmp_path / "saved"
    shutil.copytree(tmp_path / "before" / "first", saved)
    cut = tmp_path / "cut"
    shutil.copytree(saved, cut)
    (cut / WEIGHTS_NAME).write_bytes((saved / WEIGHTS_NAME).read_bytes()[:64])

    steps = 6
    continued = job_dict("continued", write_task_data(data, "second", offset=5), steps, lr=LR, lr_schedule="constant",
                         checkpoint_every=3, init_adapter=str(saved))
    broken = job_dict("broken", data / "second.jsonl", steps, init_adapter=str(cut))
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [continued, broken])
    continued_submission, broken_submission = spec.submissions()
    config = TrainerConfig(base_model=spec.base_model)
    loop = TrainerLoop(tiny_base, config, "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(broken_submission, "broken-1", tiny_base.tokenizer))
    loop.assign(assignment_for(continued_submission, "continued-1", tiny_base.tokenizer))
    events = []
    for _ in range(5):
        loop.run_once(idle_wait=0)
        events += loop.drain_events()
    failed = next(e for e in events if e.job_id == "broken-1")
    assert failed.kind == "failed"
    assert failed.data["reason"].startswith(f"could not start: init_adapter: {cut / WEIGHTS_NAME} is not a "
                                            "safetensors file")
    assert failed.data["reason"].endswith("; save the adapter again")
    started = next(e for e in events if e.job_id == "continued-1" and e.kind == "started")
    assert started.data["checkpoint_note"] == f"its adapter started from {saved}"

    loop.stop_job("continued-1", "paused", "test")
    events = run_until_idle(loop)
    paused = next(e for e in events if e.kind == "paused")
    at = paused.data["checkpoint_step"]
    assert 0 < at < steps
    shutil.rmtree(saved)   # its own checkpoint is all a resumed job needs
    again = TrainerLoop(tiny_base, config, "trainer-u", tmp_path / "state")
    again.assign(assignment_for(continued_submission, "continued-1", tiny_base.tokenizer))
    events = run_until_idle(again)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == at and "started from" not in started.data["checkpoint_note"]
    assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]
    metadata = json.loads((tmp_path / "out" / "continued" / "aspen.json").read_text())
    assert metadata["init_adapter"] == str(saved)   # its lineage, beside the adapter

    # Adam moves each weight by at most lr (1 - beta1) / sqrt(1 - beta2) a step (Kingma & Ba, section 2.1); a
    # fresh adapter would be the first job's distance from its own start away (B from zero: every lora_B entry)
    start = adapter_tensors(tmp_path / "before" / "first")
    end = adapter_tensors(tmp_path / "out" / "continued")
    bound = steps * LR * (1 - BETA1) / (1 - BETA2) ** 0.5 * 1.0001
    worst = max(float((end[key] - start[key]).abs().max()) for key in start)
    moved = max(float(start[key].abs().max()) for key in start if "lora_B" in key)
    assert worst <= bound < moved / 1000, (worst, bound, moved)
    assert worst > 0, "the job did not train"


def test_submissions_read_a_users_adapter_only_where_they_may_and_refuse_one_that_does_not_fit(tmp_path):
    from peft import LoraConfig as PeftLoraConfig

    from actors.service.accounts.users import UserBook
    from actors.service.scheduler.chained_jobs import settle
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.scheduler.submissions import SubmissionError
    from actors.service.table.job_table import JobTable
    from actors.spec.job_submission import JobSubmission
    from policies.registry import load_policy

    state = tmp_path / "state"
    data = write_task_data(tmp_path / "data", "q")
    book = UserBook.in_state_dir(state)
    book.add("a", data_roots=[str(tmp_path / "data")])
    core = SchedulerCore(JobTable(state / "jobs.sqlite"), load_policy("adaptive"), state)

    def adapter(folder, r: int = 4):
        PeftLoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"]).save_pretrained(folder)
        return folder

    def submit(name: str, init_adapter, user: str | None = "a"):
        return core.submit(JobSubmission(job=job_dict(name, data, 5, init_adapter=str(init_adapter)), user=user))

    own = adapter(state / "outputs" / "a" / "earlier" / "adapter")   # a job of theirs that went before
    assert submit("own", own).state == "queued"
    assert submit("in-root", adapter(tmp_path / "data" / "adapter")).state == "queued"
    elsewhere = adapter(tmp_path / "elsewhere")
    with pytest.raises(SubmissionError, match=rf"init_adapter {elsewhere} is outside the data roots this job may "
                                              r"read \(.*\); put it under one of them"):
        submit("elsewhere", elsewhere)
    others = adapter(state / "outputs" / "b" / "theirs")
    with pytest.raises(SubmissionError, match=r"lies in the service's outputs other than yours, which no job may "
                                              r"read"):
        submit("others", others)
    with pytest.raises(SubmissionError, match=r"init_adapter: .*missing does not exist on the service's machine"):
        submit("missing", tmp_path / "data" / "missing")
    with pytest.raises(SubmissionError, match=r"does not fit the job's lora: lora.r is 4, the adapter's r 8: set "
                                              r"lora.r: 8"):
        submit("wider", adapter(tmp_path / "data" / "wider", r=8))
    assert submit("operator", elsewhere, user=None).state == "queued"   # an operator's: no data roots configured

    # job:<name> of a job entered before: theirs, by name or id (it starts once that one has ended); not another's
    first = core.table.find("own")
    later = submit("later", "job:own")
    assert str(core.table.submission(later.id).job.init_adapter) == f"job:{first.id}"
    settled = settle(core.table, later, core.table.submission(later.id))
    assert settled.waiting == f"waits for job {first.id} (queued) to end: it starts from that job's adapter"
    # a batch repeated after a lost answer finds its job, also once the job it waited on ended and it was settled;
    # the same ids with another job are still a conflict
    from actors.service.scheduler.submissions import SubmissionConflict
    batch = [JobSubmission(job=job_dict("chained", data, 5, init_adapter="job:own"), user="a")]
    (entered,) = core.submit_many(batch, job_ids=["chained-1"])
    core.table.set_state(first.id, "completed", "done", adapter_dir=str(own))
    assert settle(core.table, entered, core.table.submission(entered.id)).submission.job.init_adapter == own
    assert [record.id for record in core.submit_many(batch, job_ids=["chained-1"])] == ["chained-1"]
    other = [JobSubmission(job=job_dict("chained", data, 6, init_adapter="job:own"), user="a")]
    with pytest.raises(SubmissionConflict, match="job id chained-1 is taken by another job"):
        core.submit_many(other, job_ids=["chained-1"])
    core.table.set_state(first.id, "cancelled", "cancelled by the user")
    assert settle(core.table, later, core.table.submission(later.id)).failed == (
        f"it starts from the adapter of job {first.id}, which ended cancelled (cancelled by the user); resume that job "
        f"(`aspen resume {first.id}`), then this one")
    book.add("b", data_roots=[str(tmp_path / "data")])
    with pytest.raises(SubmissionError, match=r"init_adapter: job:own names no job of the same submission"):
        submit("not-theirs", "job:own", user="b")


def test_a_dpo_job_from_a_saved_adapter_holds_it_as_its_reference_and_keeps_a_copy_with_its_checkpoints(
        tmp_path, tiny_base, tiny_model_dirs):
    """Through the trainer loop: a dpo job starting from a saved adapter holds a frozen copy of it as its reference
    (said in its start note), keeps that copy in its folder (a PEFT folder of the same tensors) and in each
    checkpoint, and takes it off the base when it leaves. Resumed with the saved adapter deleted meanwhile, it holds
    its checkpoint's copy and ends bit for bit as the same job run without a pause. A checkpoint of an older aspen
    (no copy) needs the saved adapter: gone, the job fails saying which file, and the trainer goes on."""
    from actors.engine.adapter_surgery import fused_layers
    from tests.helpers.pairs import ROWS

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    first = job_dict("first", write_task_data(tmp_path / "data", "first"), 3, lr=1e-2)
    train_locally(run_spec(str(tiny_model_dirs["llama"]), tmp_path / "before", [first]), base=tiny_base,
                  progress=False)
    saved = tmp_path / "saved"
    shutil.copytree(tmp_path / "before" / "first", saved)
    dpo = job_dict("dpo", pairs, 6, method="dpo", batch_size=2, format={"type": "preference"}, checkpoint_every=2,
                   init_adapter=str(saved))
    (submission,) = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [dpo]).submissions()
    (unpaused,) = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "unpaused", [dpo]).submissions()
    config = TrainerConfig(base_model=submission.base_model)
    solo = TrainerLoop(tiny_base, config, "trainer-s", tmp_path / "solo-state")
    solo.assign(assignment_for(unpaused, "dpo-1", tiny_base.tokenizer))
    assert any(e.kind == "completed" for e in run_until_idle(solo))

    def references() -> list[str]:
        return sorted({name for layer in fused_layers(tiny_base.model) for name in layer.adapters
                       if name.endswith("@reference")})

    loop = TrainerLoop(tiny_base, config, "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    events = []
    for _ in range(3):
        loop.run_once(idle_wait=0)
        events += loop.drain_events()
    started = next(e for e in events if e.kind == "started")
    assert started.data["checkpoint_note"] == f"its adapter started from {saved}; its reference is {saved}"
    assert references() == ["dpo-1@reference"]
    kept = tmp_path / "out" / "dpo" / "reference"
    assert adapter_tensors(kept).keys() == adapter_tensors(saved).keys()
    assert all(torch.equal(adapter_tensors(kept)[key], value) for key, value in adapter_tensors(saved).items())
    loop.stop_job("dpo-1", "paused", "test")
    events = run_until_idle(loop)
    assert any(e.kind == "paused" for e in events) and references() == []

    again = TrainerLoop(tiny_base, config, "trainer-u", tmp_path / "state")
    again.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    for _ in range(2):
        again.run_once(idle_wait=0)
    assert references() == ["dpo-1@reference"]   # resumed from its checkpoint: the reference held again
    again.stop_job("dpo-1", "paused", "test")
    run_until_idle(again)
    checkpoint = tmp_path / "out" / "dpo" / "checkpoint"
    older = tmp_path / "older-checkpoint"
    shutil.copytree(checkpoint, older)
    shutil.rmtree(saved)
    shutil.rmtree(kept)   # not needed either: the checkpoint holds its copy
    last = TrainerLoop(tiny_base, config, "trainer-v", tmp_path / "state")
    last.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    events = run_until_idle(last)
    started = next(e for e in events if e.kind == "started")
    assert started.data["checkpoint_note"] == f"its reference is its checkpoint's copy of {saved}"
    assert any(e.kind == "completed" for e in events), [(e.kind, e.data.get("reason")) for e in events]
    end, reference_end = adapter_tensors(tmp_path / "out" / "dpo"), adapter_tensors(tmp_path / "unpaused" / "dpo")
    assert all(torch.equal(end[key], reference_end[key]) for key in reference_end), "not as the unpaused run"
    assert references() == []

    state = json.loads((older / "state.json").read_text())   # as an aspen before the copy wrote it
    del state["files"]["reference_model.safetensors"]
    (older / "reference_model.safetensors").unlink()
    (older / "state.json").write_text(json.dumps(state))
    shutil.rmtree(checkpoint)
    shutil.copytree(older, checkpoint)
    older_one = TrainerLoop(tiny_base, config, "trainer-w", tmp_path / "state")
    older_one.assign(assignment_for(submission, "dpo-1", tiny_base.tokenizer))
    events = run_until_idle(older_one)
    failed = next(e for e in events if e.job_id == "dpo-1")
    assert failed.kind == "failed" and failed.data["reason"].startswith(
        f"could not start: init_adapter: {saved / 'adapter_config.json'} does not exist")
    assert references() == [] and "dpo-1" not in {name for layer in fused_layers(tiny_base.model)
                                                   for name in layer.adapters}


CHAIN = """\
base_model: {base}
output_dir: out
step_tokens: 2048
jobs:
  - name: sft
    data: {sft_data}
    format: {{type: prompt_response, prompt: "Q: {{question}}\\nA:", response: " {{answer}}"}}
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 4
    max_steps: 4
    lr: 1.0e-2
  - name: dpo
    method: dpo
    data: pairs.jsonl
    format: {{type: preference}}
    init_adapter: job:sft
    lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    batch_size: 2
    max_steps: 2
"""


def test_a_jobs_file_chains_sft_then_dpo_from_its_adapter(tmp_path, tiny_base, tiny_model_dirs):
    """`init_adapter: job:sft` in one jobs file, run through the service in-process: the dpo job waits for the sft
    job, starts from the adapter it ended with (its folder, which its adapter's aspen.json names) and compares itself
    with it (its first step's reward margin is 0: policy and reference are the same adapter, which the sft job moved
    off the base); where the sft job fails, the dpo job fails saying so, and nothing else stops."""
    from orchestrator.jobs_file import load_run_spec
    from tests.helpers.pairs import ROWS

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    data = write_task_data(tmp_path / "data", "qa")
    (tmp_path / "jobs.yaml").write_text(CHAIN.format(base=tiny_model_dirs["llama"], sft_data=data))
    results = {r.name: r for r in train_locally(load_run_spec(tmp_path / "jobs.yaml"), base=tiny_base,
                                                 progress=False)}
    assert results["sft"].state == results["dpo"].state == "completed", results["dpo"].reason
    sft_adapter = tmp_path / "out" / "sft"
    assert json.loads((tmp_path / "out" / "dpo" / "aspen.json").read_text())["init_adapter"] == str(sft_adapter)
    assert any(float(t.abs().max()) > 0 for k, t in adapter_tensors(sft_adapter).items() if "lora_B" in k)
    first = json.loads((tmp_path / "out" / "dpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["rewards/margins"]) <= 1e-5 and abs(first["loss"] - 0.693147) <= 1e-5, first

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pairs.jsonl").write_text((tmp_path / "pairs.jsonl").read_text())
    (broken / "bad.jsonl").write_text('{"question": "1", "answer": "2"}\n{"question": "3"}\n')
    (broken / "jobs.yaml").write_text(CHAIN.format(base=tiny_model_dirs["llama"], sft_data=broken / "bad.jsonl"))
    spec = load_run_spec(broken / "jobs.yaml", check_files=False)   # a bad row is found when the job starts
    results = {r.name: r for r in train_locally(spec, base=tiny_base, progress=False)}
    assert results["sft"].state == "failed"
    assert results["dpo"].state == "failed"
    assert "it starts from the adapter of job sft, which ended failed" in results["dpo"].reason, results["dpo"].reason
    assert results["dpo"].reason.endswith("resume that job (`aspen resume sft`), then this one")
