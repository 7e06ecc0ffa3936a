"""The actor system on a real (local) Ray: jobs join a running trainer, cancel leaves a loadable
checkpoint, a killed trainer is replaced and its job ends with the same adapter as an uninterrupted
run, a killed scheduler comes back with every job, a job nobody can train waits with a reason, and a GRPO job's
rewards of the user's (a module's and a file's) score in the trainer actor's process of users' functions, its
rewards in the job table's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from actors.engine.models import load_base_model
from actors.service.scheduler.local_run import train_locally
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from orchestrator.client import Client
from orchestrator.jobs_file import SpecError
from tests.helpers.service import (
    adapter_tensors,
    job_dict,
    max_relative_difference,
    run_again,
    run_spec,
    service_config,
    wait_for,
    write_task_data,
)


@pytest.fixture(scope="module")
def service(ray_session, tiny_model_dirs, tmp_path_factory):
    client = Client.local(service_config(tmp_path_factory.mktemp("state"), tiny_model_dirs["llama"]))
    yield client
    client.shutdown()


def test_jobs_submitted_while_others_run_join_without_a_restart(service, tiny_model_dirs, tmp_path):
    data = tmp_path / "data"
    base = str(tiny_model_dirs["llama"])
    first = service.submit(job_dict("first", write_task_data(data, "first"), 5000), base_model=base,
                           output_dir=tmp_path / "first")
    wait_for(lambda: service.status(first.id).step >= 3, what="the first job to train")
    incarnation = service.trainers()[0]["incarnation"]
    # each job's real tokens in the trainer's last fused step (the console's share), as its step log has them
    last = wait_for(lambda: service.trainers()[0]["last_step_job_tokens"], what="the trainer's last step")
    logged = [json.loads(line) for line in
              (Path(service.info()["state_dir"]) / "trainers" / "trainer-0.jsonl").read_text().splitlines()]
    assert last.keys() == {first.id} and last[first.id] in {row["job_tokens"][first.id] for row in logged}
    second = service.submit(job_dict("second", write_task_data(data, "second", offset=3), 5), base_model=base,
                            output_dir=tmp_path / "second")
    done_second = second.wait(timeout=120)
    assert done_second.state == "completed", done_second
    assert service.status(first.id).state == "running"      # the second joined and left while the first ran
    service.cancel(first.id)
    assert first.wait(timeout=60).state == "cancelled"
    trainer = service.trainers()[0]
    assert trainer["incarnation"] == incarnation and trainer["restarts"] == 0 and trainer["stages"] == 1
    rows = [json.loads(line) for line in
            (Path(service.info()["state_dir"]) / "trainers" / "trainer-0.jsonl").read_text().splitlines()]
    shared = [row for row in rows if set(row["jobs"]) == {first.id, second.id}]
    assert shared and shared[0]["step"] > 3
    losses = second.losses()
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5] and all(r["loss"] > 0 for r in losses)
    states = [state for _, state, _ in service.transitions(second.id)]
    assert states[0] == "queued" and states[-1] == "completed" and "running" in states
    assert (tmp_path / "second" / "adapter_model.safetensors").is_file()


def test_cancel_mid_run_leaves_a_loadable_checkpoint(service, tiny_model_dirs, tmp_path):
    data = write_task_data(tmp_path / "data", "long")
    # cancelled while it trains: the cancel follows step 3 as the scheduler's table shows it, a poll behind the
    # trainer (at step 22 here); 5000 steps leave >=20 s at a >=5 ms floor and cost nothing (it is cancelled)
    handle = service.submit(job_dict("long", data, 5000, checkpoint_every=100),
                            base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "long")
    wait_for(lambda: handle.status().step >= 3, what="the job to train")
    service.cancel(handle.id)
    record = handle.wait(timeout=60)
    assert record.state == "cancelled" and record.checkpoint_step is not None and record.checkpoint_step >= 3
    checkpoint = tmp_path / "long" / "checkpoint"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == record.checkpoint_step
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    peft_model = PeftModel.from_pretrained(model, checkpoint)
    saved = adapter_tensors(checkpoint)
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved) > 0
    assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)   # it did train
    with pytest.raises(ValueError, match="already ended"):
        service.cancel(handle.id)


def test_bad_specs_fail_at_submit_and_unheld_base_models_wait_with_a_reason(service, tmp_path):
    with pytest.raises(SpecError, match=r"data: file .*missing.jsonl does not exist"):
        service.submit(job_dict("nodata", tmp_path / "missing.jsonl", 5))
    data = write_task_data(tmp_path / "data", "t")
    with pytest.raises(SpecError, match=r"lora\.r: must be between 1 and 1024"):
        service.submit({**job_dict("badr", data, 5), "lora": {"r": 0}})
    handle = service.submit(job_dict("orphan", data, 5), base_model="some-org/model-nobody-holds")
    record = wait_for(lambda: (r := handle.status()).reason.startswith("no trainer") and r, what="a reason")
    assert record.state == "queued"
    assert "some-org/model-nobody-holds" in record.reason and "trainers hold" in record.reason
    assert service.cancel(handle.id).state == "cancelled"
    # specs cross to the scheduler as the validated objects the client built; anything else is refused there,
    # saying what came, and nothing is entered
    before = len(service.jobs())
    with pytest.raises(TypeError, match=r"submission 1 of 1 must arrive as a "
                                        r"actors\.spec\.job_submission\.JobSubmission, not a builtins\.str"):
        service._request("submit_many", [JobSubmission(job=job_dict("as-json", data, 5)).model_dump_json()])
    assert len(service.jobs()) == before


def test_jobs_of_one_run_file_share_every_step_as_in_process(service, tiny_model_dirs, tmp_path):
    """A jobs file's jobs start together: the service's fused steps hold the same jobs as the in-process
    engine's steps for the same file (none trains its first steps alone while the others' data loads)."""
    base = str(tiny_model_dirs["llama"])
    jobs = [job_dict(name, write_task_data(tmp_path / "data", name, offset=index), 6)
            for index, name in enumerate(["alpha", "beta", "gamma"])]
    handles = service.submit_run(run_spec(base, tmp_path / "service", jobs, step_tokens=512))
    assert all(h.wait(timeout=180).state == "completed" for h in handles)
    names = {h.id: h.name for h in handles}
    log = Path(service.info()["state_dir"]) / "trainers" / "trainer-0.jsonl"
    service_steps = [sorted(names[j] for j in row["jobs"])
                     for row in map(json.loads, log.read_text().splitlines()) if set(row["jobs"]) & set(names)]
    train_locally(run_spec(base, tmp_path / "local", jobs, step_tokens=512),
                  base=load_base_model(base, dtype="float32", device="cpu"), progress=False)
    local_lines = (tmp_path / "local/trainer.jsonl").read_text().splitlines()
    local_steps = [sorted(json.loads(line)["jobs"]) for line in local_lines]
    assert local_steps == [["alpha", "beta", "gamma"]] * 6
    assert service_steps == local_steps


def test_a_jobs_file_without_output_dir_writes_where_the_service_puts_jobs(service, tiny_model_dirs, tmp_path,
                                                                            monkeypatch):
    """A jobs file that names no output_dir: each job goes where the service puts a job without one (a shared
    service's output root, here its state folder), not under the submitting process's `runs/example` (which
    a shared service would refuse as outside its root)."""
    monkeypatch.chdir(tmp_path)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "unused",
                    [job_dict("nofolder", write_task_data(tmp_path / "data", "nofolder"), 2)], step_tokens=512)
    unset = RunSpec.model_validate(spec.model_dump(mode="json", exclude={"output_dir"}))
    (handle,) = service.submit_run(unset)
    assert handle.wait(timeout=120).state == "completed"
    folder = Path(service.status(handle.id).output_dir)
    assert folder.is_relative_to(Path(service.info()["state_dir"]).resolve()), folder
    assert (folder / "adapter_model.safetensors").is_file() and not (tmp_path / "runs").exists()


def test_a_jobs_files_relative_output_dir_on_a_service_without_an_output_root_is_the_files_folder(
        service, tiny_model_dirs, tmp_path, monkeypatch):
    """A service of this process (`Client.local`, no output root): a jobs file's relative output_dir is taken from
    the file's folder, where `aspen run` of the same file writes (its spec, read as `aspen run` reads it, is the
    reference), not from the submitting process's folder nor the scheduler's."""
    import yaml

    from orchestrator.jobs_file import load_run_spec

    assert not service.info()["output_root"]
    project = tmp_path / "project"
    jobs_file = project / "jobs.yaml"
    data = write_task_data(project / "data", "beside")
    jobs_file.write_text(yaml.safe_dump({"base_model": str(tiny_model_dirs["llama"]), "output_dir": "runs/beside",
                                         "jobs": [job_dict("beside", data, 2)]}))
    monkeypatch.chdir(tmp_path)   # elsewhere than the file
    (handle,) = service.submit_run(jobs_file)
    (as_aspen_run,) = load_run_spec(jobs_file).submissions()
    assert service.status(handle.id).output_dir == str(as_aspen_run.output_dir) == str(project / "runs/beside/beside")
    assert handle.wait(timeout=120).state == "completed"


@pytest.mark.long   # 42 s on CI's machine of 2026-12-04: a trainer killed, replaced, its job trained to its end
def test_a_killed_trainer_is_replaced_and_its_job_ends_as_if_uninterrupted(ray_session, tiny_model_dirs, tmp_path):
    import ray

    base = tiny_model_dirs["llama"]
    # The kill must come while the job trains: after its status shows step 25 (past the checkpoint at 20), late
    # by a poll (the status is the scheduler's table, which books the trainer's reports a poll round-trip later:
    # the trainer was at 40 when it read 29 on an idle machine here, and a loaded 2-core machine's scheduler, at
    # nice 10, can be seconds late). At 120 steps, 6-13 ms each, 95 were left; 400 steps after step 25 leave
    # >=2 s at a >=5 ms floor. Every step is trained twice (the run, its reference), so more only cost time
    steps = 425
    job = job_dict("survivor", write_task_data(tmp_path / "data", "survivor"), steps, checkpoint_every=20)
    spec = run_spec(str(base), tmp_path / "out", [job], step_tokens=512)
    client = Client.local(service_config(tmp_path / "state", base))
    try:
        (handle,) = client.submit_run(spec)
        wait_for(lambda: handle.status().step >= 25, what="the job to pass a checkpoint")
        trainer = client.trainers()[0]
        ray.kill(ray.get_actor(trainer["actor_name"]))
        record = handle.wait(timeout=240)
        assert record.state == "completed", record
        assert client.trainers()[0]["restarts"] == 1
        reasons = [reason for _, _, reason in client.transitions(handle.id)]
        assert any("was lost" in r for r in reasons), ("the job ended before the kill?", reasons)
        assert [r["step"] for r in handle.losses()] == list(range(1, steps + 1)), (
            handle.losses(), client.transitions(handle.id), record)
    finally:
        client.shutdown()
    reference = run_spec(str(base), tmp_path / "reference", [job], step_tokens=512)
    train_locally(reference, base=load_base_model(str(base), dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out/survivor"),
                                         adapter_tensors(tmp_path / "reference/survivor"))
    assert difference <= 1e-4, difference


@pytest.mark.long
def test_a_killed_scheduler_comes_back_with_every_job(ray_session, tiny_model_dirs, tmp_path):
    import ray

    base = tiny_model_dirs["llama"]
    data = tmp_path / "data"
    config = service_config(tmp_path / "state", base)
    client = Client.local(config, name="aspen-scheduler-restart-test")
    done = client.submit(job_dict("quick", write_task_data(data, "quick"), 3), base_model=str(base))
    assert done.wait(timeout=120).state == "completed"
    # The job must still be running after the restart, seen resumed and cancelled: its trainer, the dead
    # scheduler's actor, trains on until it dies with it (here the table said checkpoint 12 and the job resumed
    # from 34; a loaded machine adds seconds), and the resumed job is seen a poll late (9 steps in, here). At
    # 400 steps, 6-13 ms each, ~360 were left; 5000 leave >=20 s at a >=5 ms floor, and cost nothing (cancelled)
    running = client.submit(job_dict("slow", write_task_data(data, "slow"), 5000, checkpoint_every=2),
                            base_model=str(base))
    wait_for(lambda: (client.status(running.id).checkpoint_step or 0) >= 2, what="a checkpoint")
    queued = client.submit(job_dict("elsewhere", write_task_data(data, "e"), 3), base_model="not/held")
    ray.kill(client.scheduler)
    wait_for(lambda: _gone(ray, "aspen-scheduler-restart-test"), what="the scheduler to die")

    client = Client.local(config, name="aspen-scheduler-restart-test")
    try:
        jobs = {r.id: r for r in client.jobs()}
        assert jobs[done.id].state == "completed"
        assert jobs[queued.id].state == "queued"
        assert running.id in jobs
        record = wait_for(lambda: (r := client.status(running.id)).state == "running" and "resumed" in r.reason and r,
                          what="the unfinished job to resume")
        assert record.step >= 2
        client.cancel(running.id)
        client.cancel(queued.id)
        assert client.wait(running.id, timeout=60).state == "cancelled"
    finally:
        client.shutdown()


def _gone(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return True
    return False


def test_pause_resume_and_early_stop_through_the_actors(service, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    paused = service.submit(job_dict("pausable", write_task_data(data, "p"), 3000, checkpoint_every=1000),
                            base_model=base, output_dir=tmp_path / "pausable")
    flat = service.submit(job_dict("flat", write_task_data(data, "flat"), 60, lr=1e-7, lr_schedule="constant",
                                   eval_split=8, eval_every=2, early_stop={"min_improvement": 0.05, "patience": 3}),
                          base_model=base, output_dir=tmp_path / "flat")
    wait_for(lambda: paused.status().step >= 3, what="the job to train")
    service.pause(paused.id)
    record = wait_for(lambda: (r := paused.status()).state == "paused" and r, what="the job to pause")
    assert record.checkpoint_step == record.step >= 3
    service.resume(paused.id)
    record = wait_for(lambda: (r := paused.status()).state == "running" and "resumed from step" in r.reason and r,
                      what="the job to resume")
    service.cancel(paused.id)
    assert paused.wait(timeout=60).state == "cancelled"

    ended = flat.wait(timeout=180)
    assert ended.state == "stopped_early", ended
    assert "has not improved on its best" in ended.reason and "min_delta" in ended.reason and ended.step < 60
    losses = flat.losses()
    assert sum(r["eval_loss"] is not None for r in losses) >= 4       # evaluated every 2 steps
    assert (tmp_path / "flat" / "adapter_model.safetensors").is_file()
    # raised, it trains on from its checkpoint without the rule that ended it (which would end it again at once)
    raised = service.raise_max_steps("flat", 62)
    assert raised.state == "queued" and "without the early_stop rule" in raised.reason, raised.reason
    grown = flat.wait(timeout=180)
    assert (grown.state, grown.step) == ("completed", 62), grown
    assert [r["step"] for r in flat.losses()] == list(range(1, 63))
    assert service.submission(flat.id).job.early_stop is None


def test_a_grpo_jobs_rewards_of_the_users_score_on_a_trainer_actor(service, tiny_model_dirs, tmp_path):
    import shutil

    shutil.copy(Path(__file__).resolve().parents[1] / "helpers" / "rewards.py", tmp_path / "mine.py")
    job = job_dict("grpo", write_task_data(tmp_path / "data", "grpo"), 2, method="grpo", batch_size=2, max_seq_len=64,
                   grpo={"reward": ["tests.helpers.rewards:shorter", f"{tmp_path / 'mine.py'}:sevens"],
                         "num_generations": 2, "max_new_tokens": 4})
    handle = service.submit(job, base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "grpo")
    done = handle.wait(timeout=180)
    assert done.state == "completed", done
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(0 < row["rewards/shorter/mean"] <= 1 and 0 <= row["rewards/sevens/mean"] <= 1 for row in rows), rows
    # the job table has each step's rewards as metrics.jsonl has them (aspen losses, the HTTP API, the console)
    table = {row["step"]: row for row in handle.losses()}
    for row in rows:
        assert {name: table[row["step"]][name] for name in row} == row
    assert handle.status().reward == rows[-1]["reward"]   # its record (aspen status, Prometheus) has the last one


def test_a_jobs_file_chains_sft_then_dpo_through_the_actors(service, tiny_model_dirs, tmp_path):
    """`init_adapter: job:sft` through the service on Ray: the dpo job starts once the sft job has ended, from its
    adapter folder (its submission holds it), with that adapter as its reference (its first margin is 0)."""
    from tests.helpers.pairs import ROWS

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    sft = job_dict("sft", write_task_data(tmp_path / "data", "sft"), 4, lr=1e-2)
    dpo = job_dict("dpo", pairs, 2, method="dpo", batch_size=2, format={"type": "preference"}, init_adapter="job:sft")
    first, second = service.submit_run(run_spec(str(tiny_model_dirs["llama"]), tmp_path / "chain", [sft, dpo],
                                                step_tokens=512))
    assert first.wait(timeout=180).state == "completed"
    assert second.wait(timeout=180).state == "completed", second.status()
    assert second.status().started_at >= first.status().finished_at
    assert str(service.submission(second.id).job.init_adapter) == first.status().adapter_dir
    margin = json.loads((tmp_path / "chain" / "dpo" / "metrics.jsonl").read_text().splitlines()[0])["rewards/margins"]
    assert abs(margin) <= 1e-5


def test_the_stop_rule_of_a_job_its_epochs_raised_fires_through_the_actors(service, tiny_model_dirs, tiny_base,
                                                                             tmp_path):
    """tests/unit/service/test_epochs_raised.py's job continued with more epochs, through the scheduler and trainer
    actors: 10 rows in batches of 4 (1 epoch: 3 steps, too few for the rule, patience 1 and a min_improvement no gain
    reaches, to judge a step), raised to 2 epochs it trains on from its next epoch's first row and its rule, given
    the new total (6), stops it judging step 4: where and why the same job ends raised in process (the reference)."""
    from actors.service.table.job_table import read_jobs

    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data" / "t.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"question": f"n {i}", "answer": f"{i}"}) + "\n" for i in range(10)))
    job = job_dict("es", data, None, epochs=1, lr_schedule="constant", eval_every=1,
                   early_stop={"min_improvement": 100, "patience": 1})
    handle = service.submit(job, base_model=base, output_dir=tmp_path / "service")
    assert (r := handle.wait(timeout=180)).state == "completed" and r.step == 3, r
    raised = service.raise_budget(handle.id, epochs=2)
    assert raised.state == "queued", raised
    ended = handle.wait(timeout=180)

    def spec(epochs: float):   # the reference: the same job, raised in process
        return RunSpec.model_validate({"base_model": base, "output_dir": str(tmp_path / "local"), "step_tokens": 1024,
                                       "jobs": [{**job, "epochs": epochs}]})
    train_locally(spec(1), base=tiny_base, progress=False, record_in=tmp_path / "local/.aspen")
    run_again(spec(2), base=tiny_base)
    (local, _), = read_jobs(tmp_path / "local/.aspen/jobs.sqlite")
    assert local.state == "stopped_early" and "(step 4" in local.reason, local
    assert (ended.state, ended.step) == (local.state, local.step), (ended, local)
    assert ended.reason == local.reason, (ended.reason, local.reason)
    assert ended.total_steps == local.total_steps == 6, (ended.total_steps, local.total_steps)   # the new total
    assert [r["step"] for r in handle.losses()] == list(range(1, ended.step + 1))
