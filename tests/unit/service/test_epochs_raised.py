"""A job's `epochs` raised, as transformers' `resume_from_checkpoint` with a larger `num_train_epochs`: `aspen run`
again (in process: its plan, `_plan_in_process`, then `train_locally` carrying the raised job as `aspen run
--in-process` does) continues the job from its checkpoint into its next epoch. The references are independent of
the code continuing it: a job given 2 epochs from the start (its training rows a multiple of batch_size, at a
constant learning rate: the same batches, so exactly the same adapter), and, where the rows are not a multiple,
the tokens of its data (each row of the new epoch once: the continued job's tokens are twice its first epoch's)
and its cursor's end in its checkpoint (it ended there, not a step early)."""

from __future__ import annotations

import json

import pytest
import torch

from actors.service.scheduler.local_run import train_locally
from actors.service.table.job_table import read_jobs
from tests.helpers.service import adapter_tensors, job_dict, run_again, run_spec, write_task_data


def _spec(tmp_path, base, data, epochs: float, folder: str = "out", **extra):
    jobs = [job_dict(name, data, None, epochs=epochs, lr_schedule="constant", **extra.get(name, {}))
            for name in ("ga1", "ga2")]
    return run_spec(str(base), tmp_path / folder, jobs, step_tokens=1024)


def _run_again(spec, base) -> list:
    """`aspen run --in-process` on the same folder (tests/helpers/service.py)."""
    return run_again(spec, base=base)


def _state(folder) -> dict:
    return json.loads((folder / "checkpoint" / "state.json").read_text())


def test_epochs_raised_continues_the_job_and_ends_as_one_given_them_from_the_start(tmp_path, tiny_base,
                                                                                   tiny_model_dirs, capsys):
    """16 rows in batches of 4 (grad_accum 1 and 2): 1 epoch, then `aspen run` again with 2: the job continues from
    its checkpoint at step 4 (2) to step 8 (4), its adapter exactly that of the job trained 2 epochs at once."""
    base = tiny_model_dirs["llama"]
    data = write_task_data(tmp_path / "data", "t", rows=16)
    extra = {"ga2": {"grad_accum": 2}}
    first = train_locally(_spec(tmp_path, base, data, 1, **extra), base=tiny_base, progress=False,
                          record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 4), ("completed", 2)]
    capsys.readouterr()

    again = _run_again(_spec(tmp_path, base, data, 2, **extra), tiny_base)
    out = capsys.readouterr().out
    assert "ga1: completed at step 4; epochs raised to 2: it continues from its checkpoint at step 4" in out, out
    assert "ga2: completed at step 2; epochs raised to 2: it continues from its checkpoint at step 2" in out, out
    assert [(s.state, s.steps) for s in again] == [("completed", 8), ("completed", 4)]
    records = {record.name: record for record, _ in read_jobs(tmp_path / "out/.aspen/jobs.sqlite")}
    assert (records["ga1"].total_steps, records["ga2"].total_steps) == (8, 4)

    train_locally(_spec(tmp_path, base, data, 2, "reference", **extra), base=tiny_base, progress=False)
    for name in ("ga1", "ga2"):
        ours, theirs = adapter_tensors(tmp_path / "out" / name), adapter_tensors(tmp_path / "reference" / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
        metrics = (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in metrics]
        assert steps == list(range(1, 9 if name == "ga1" else 5)), (name, steps)


@pytest.mark.parametrize("read", [{}, {"streaming": True, "shuffle_window": 3}], ids=["loaded", "streamed"])
def test_epochs_raised_on_rows_not_a_multiple_of_batch_size_sees_each_row_of_the_new_epoch_once(tmp_path, tiny_base,
                                                                                             tiny_model_dirs, read):
    """10 rows in batches of 4: the first epoch's last batch is short (2 rows, 3 steps). Raised to 2 epochs, the job
    trains the next epoch from its first row: 3 more steps of 4, 4 and 2 rows (a job given 2 epochs at once takes 5
    steps, its batches running on across the epoch's end; planned so, the continued job ended a step early, 2 rows of
    its new epoch unseen). With grad_accum 2: 2 steps more, the first of 2 whole micro-batches (its next epoch's
    accumulation begun afresh, as the first's). Each row has as many tokens as any other: a step's tokens count its
    rows. Streamed (3 rows read at a time) alike: its position counts rows."""
    base = tiny_model_dirs["llama"]
    data = tmp_path / "data" / "t.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"question": f"n {i}", "answer": f"{i}"}) + "\n" for i in range(10)))
    extra = {"ga1": read, "ga2": {**read, "grad_accum": 2}}
    first = train_locally(_spec(tmp_path, base, data, 1, **extra), base=tiny_base, progress=False,
                          record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 3), ("completed", 2)]
    one_epoch = {name: _state(tmp_path / "out" / name)["tokens_seen"] for name in ("ga1", "ga2")}

    again = _run_again(_spec(tmp_path, base, data, 2, **extra), tiny_base)
    assert [(s.state, s.steps) for s in again] == [("completed", 6), ("completed", 4)]
    for name in ("ga1", "ga2"):
        state = _state(tmp_path / "out" / name)
        assert state["tokens_seen"] == 2 * one_epoch[name], name   # each row of its data once more
        assert (state["cursor"]["epoch"], state["cursor"]["position"]) == (1, 10), state["cursor"]
        assert state["cursor"]["examples_seen"] == 20
    tokens = {name: [json.loads(line)["tokens"] for line in (tmp_path / "out" / name / "metrics.jsonl").read_text()
                     .splitlines()] for name in ("ga1", "ga2")}
    row = tokens["ga1"][2] // 2   # the first epoch's last step: 2 rows
    assert tokens["ga1"] == [4 * row, 4 * row, 2 * row] * 2, tokens
    assert tokens["ga2"] == [8 * row, 2 * row] * 2, tokens


def test_epochs_raised_after_a_short_last_step_begin_the_next_accumulation_afresh_where_the_totals_agree(
        tmp_path, tiny_base, tiny_model_dirs):
    """20 rows in batches of 4, grad_accum 3: 1 epoch is 2 steps (3 and 2 micro-batches: its data ended
    mid-accumulation). Raised to 2 epochs it takes 2 more steps of 3 and 2 micro-batches, each row of its new epoch
    once: its tokens twice its first epoch's, its cursor at its second epoch's end. A job given 2 epochs at once plans
    ceil(10 / 3) = 4 steps too; the continued job must not take that for "nothing to change" and finish its first
    epoch's accumulation with its new epoch's first micro-batch (its step 3 of 1 micro-batch, its last row unseen)."""
    base = tiny_model_dirs["llama"]
    data = write_task_data(tmp_path / "data", "t", rows=20)

    def spec(epochs: float):
        job = job_dict("ga3", data, None, epochs=epochs, lr_schedule="constant", grad_accum=3)
        return run_spec(str(base), tmp_path / "out", [job], step_tokens=1024)
    first = train_locally(spec(1), base=tiny_base, progress=False, record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 2)]
    one_epoch = _state(tmp_path / "out" / "ga3")["tokens_seen"]
    again = _run_again(spec(2), tiny_base)
    assert [(s.state, s.steps) for s in again] == [("completed", 4)]
    state = _state(tmp_path / "out" / "ga3")
    assert (state["cursor"]["epoch"], state["cursor"]["position"], state["cursor"]["examples_seen"]) == (1, 20, 40)
    assert state["tokens_seen"] == 2 * one_epoch


def test_the_stop_rule_of_a_job_its_epochs_raised_judges_it_against_its_new_total(tmp_path, tiny_base,
                                                                                  tiny_model_dirs):
    """10 rows in batches of 4 (1 epoch: 3 steps), early_stop judging each step (patience 1, a min_improvement no
    remaining gain reaches: the rule stops the job at the first step it may judge, its 4th point, where that step +
    patience is before the end of the budget it is given). Raised to 2 epochs the job trains on from its next
    epoch's first row; the reference, the same job raised without early_stop, trains to its new total: 6 steps. A
    job given 2 epochs at once plans ceil(20 / 4) = 5 (its batches running on across the epoch's end): a rule given
    that total judges no step (4 + 1 is not before 5), and the job trains on to step 6 past it; given the new total
    the rule stops the job judging step 4."""
    base = tiny_model_dirs["llama"]
    data = tmp_path / "data" / "t.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"question": f"n {i}", "answer": f"{i}"}) + "\n" for i in range(10)))
    rule = {"early_stop": {"min_improvement": 100, "patience": 1}, "eval_every": 1}
    ended = {}
    for folder, extra in (("out", rule), ("reference", {})):
        def spec(epochs: float, folder=folder, extra=extra):
            job = job_dict("es", data, None, epochs=epochs, lr_schedule="constant", **extra)
            return run_spec(str(base), tmp_path / folder, [job], step_tokens=1024)
        first = train_locally(spec(1), base=tiny_base, progress=False, record_in=tmp_path / folder / ".aspen")
        assert [(s.state, s.steps) for s in first] == [("completed", 3)]
        ended[folder] = _run_again(spec(2), tiny_base)
    assert [(s.state, s.steps) for s in ended["reference"]] == [("completed", 6)]
    (record, _), = read_jobs(tmp_path / "out/.aspen/jobs.sqlite")
    assert record.state == "stopped_early" and record.step < 6, (record.state, record.step, record.reason)
    assert "(step 4" in record.reason and ("at step 6:" in record.reason or "has not improved" in record.reason), \
        record.reason   # judged at step 4 (the trainer applies a verdict a step or so later: VERDICT_LAG)


def test_a_streamed_job_its_epochs_raised_continues_as_one_given_them_from_the_start(tmp_path, tiny_base,
                                                                                     tiny_model_dirs):
    """The first test's jobs with their data streamed (read 5 rows at a time, each window shuffled: 4 windows, the
    last of 1 row): raised from 1 epoch to 2 they continue from the stream's end to exactly the adapters of the same
    streamed jobs given 2 epochs from the start."""
    base = tiny_model_dirs["llama"]
    data = write_task_data(tmp_path / "data", "t", rows=16)
    stream = {"streaming": True, "shuffle_window": 5}
    extra = {"ga1": stream, "ga2": {**stream, "grad_accum": 2}}
    first = train_locally(_spec(tmp_path, base, data, 1, **extra), base=tiny_base, progress=False,
                          record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", 4), ("completed", 2)]
    again = _run_again(_spec(tmp_path, base, data, 2, **extra), tiny_base)
    assert [(s.state, s.steps) for s in again] == [("completed", 8), ("completed", 4)]
    train_locally(_spec(tmp_path, base, data, 2, "reference", **extra), base=tiny_base, progress=False)
    for name in ("ga1", "ga2"):
        ours, theirs = adapter_tensors(tmp_path / "out" / name), adapter_tensors(tmp_path / "reference" / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
        assert _state(tmp_path / "out" / name)["cursor"] == _state(tmp_path / "reference" / name)["cursor"]


@pytest.mark.parametrize(("rows", "raise_", "steps"), [
    (16, (1.5, 2.5), {"ga1": (6, 10), "ga3": (2, 4)}),   # its checkpoint mid-epoch: on across the epoch's end
    (10, (1.5, 2.5), {"ga1": (4, 7), "ga2": (2, 4)}),    # rows not a multiple of batch_size: the same
    (16, (1.5, 2.5), {"ga1": (6, 10), "ga4": (2, 3)}),   # 2 steps of 4 took its cursor's every row: on from there
    (16, (1, 1.5), {"ga1": (4, 6), "ga2": (2, 3)}),      # a whole number raised to a fraction
    (10, (1.5, 2), {"ga1": (4, 5), "ga3": (2, 2)}),      # ga3's 2 steps took its 2 epochs' rows: nothing more
], ids=["mid-epoch", "short-rows", "cursor-end", "to-a-fraction", "already-there"])
def test_fractional_epochs_raised_continue_as_a_job_given_them_from_the_start(tmp_path, tiny_base, tiny_model_dirs,
                                                                              rows, raise_, steps):
    """Fractional epochs, e.g. 1.5 raised to 2.5: the job continues from its checkpoint to exactly the adapter, the
    steps and the data position of the job given the larger epochs from the start (grad_accum 1 and 2 to 4)."""
    _raise_and_compare(tmp_path, tiny_base, tiny_model_dirs["llama"], rows, raise_, steps, exact=True)


def test_fractional_epochs_raised_after_a_step_its_data_ended_short_continue_as_whole_epochs_do(tmp_path, tiny_base,
                                                                                                tiny_model_dirs):
    """10 rows in batches of 4, grad_accum 3, 1.5 epochs: 4 micro-batches planned, so 2 steps, the second taking
    micro-batches up to its cursor's end (its 2 epochs, 5 micro-batches: 3 and 2, the data then ended
    mid-accumulation). Raised to 2.5 it continues as a raise of whole epochs does: from its next epoch's first row,
    its accumulation begun afresh (job_spec.continued_steps), 1 step of 3 micro-batches to its third epoch's end. A
    job given 2.5 epochs at once (3 steps planned, as the continued one) groups its 8 micro-batches 3, 3 and 2, its
    batches running on across each epoch's end: the same rows (its data position and tokens the same) in other
    batches and steps, so not the same adapter; exact only by training the first run's last step otherwise."""
    _raise_and_compare(tmp_path, tiny_base, tiny_model_dirs["llama"], 10, (1.5, 2.5), {"ga3": (2, 3)}, exact=False)


def _raise_and_compare(tmp_path, tiny_base, base, rows: int, raise_: tuple[float, float],
                       steps: dict[str, tuple[int, int]], *, exact: bool) -> None:
    """Jobs `steps` names (gaN: grad_accum N, its steps before and after) trained to `raise_[0]` epochs, raised to
    `raise_[1]`, against the same jobs given `raise_[1]` at once: data position and tokens the same, and (`exact`)
    the same adapter."""
    data = write_task_data(tmp_path / "data", "t", rows=rows)

    def spec(epochs: float, folder: str):
        jobs = [job_dict(name, data, None, epochs=epochs, lr_schedule="constant", grad_accum=int(name[2:]))
                for name in steps]
        return run_spec(str(base), tmp_path / folder, jobs, step_tokens=1024)
    first = train_locally(spec(raise_[0], "out"), base=tiny_base, progress=False, record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", before) for before, _ in steps.values()]
    again = _run_again(spec(raise_[1], "out"), tiny_base)
    assert [(s.state, s.steps) for s in again] == [("completed", after) for _, after in steps.values()]
    reference = train_locally(spec(raise_[1], "reference"), base=tiny_base, progress=False)
    if exact:
        assert [s.steps for s in reference] == [s.steps for s in again]
    for name in steps:
        ours, theirs = _state(tmp_path / "out" / name), _state(tmp_path / "reference" / name)
        assert (ours["cursor"], ours["tokens_seen"]) == (theirs["cursor"], theirs["tokens_seen"]), name
        if exact:
            ours, theirs = adapter_tensors(tmp_path / "out" / name), adapter_tensors(tmp_path / "reference" / name)
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[key], theirs[key]) for key in ours), name


@pytest.mark.parametrize(("rows", "steps"), [(8, (4, 8)), (6, (4, 8))], ids=["whole-generations", "short-generation"])
def test_a_grpo_job_replaying_its_generations_continues_its_raised_epochs(tmp_path, tiny_base, tiny_model_dirs,
                                                                          rows, steps):
    """GRPO with num_iterations 2 (each generation, grad_accum 2 micro-batches of 2 prompts, trained on for 2
    steps), 1 epoch raised to 2. 8 rows: 2 generations an epoch, 4 steps; it continues from its checkpoint to exactly
    the adapter, data position and metrics of the job given 2 epochs at once. 6 rows: its epoch's last generation is
    1 micro-batch (cut short by the data's end, replayed too); the raised job samples its next epoch's generations
    afresh from its first row, as the first epoch's: 4 steps more, its cursor at its second epoch's end (a job
    given 2 epochs at once runs its batches across the epoch's end: 3 generations, 6 steps)."""
    base = tiny_model_dirs["llama"]
    data = write_task_data(tmp_path / "data", "arith", rows=rows)

    def spec(epochs: float, folder: str):
        job = job_dict("grpo", data, None, epochs=epochs, lr_schedule="constant", method="grpo", batch_size=2,
                       grad_accum=2, max_seq_len=64, grpo={"reward": "contains", "num_generations": 3,
                                                           "max_new_tokens": 6, "num_iterations": 2})
        return run_spec(str(base), tmp_path / folder, [job], step_tokens=2048)
    first = train_locally(spec(1, "out"), base=tiny_base, progress=False, record_in=tmp_path / "out/.aspen")
    assert [(s.state, s.steps) for s in first] == [("completed", steps[0])], first[0].reason
    again = _run_again(spec(2, "out"), tiny_base)
    assert [(s.state, s.steps) for s in again] == [("completed", steps[1])], again[0].reason
    cursor = _state(tmp_path / "out/grpo")["cursor"]
    assert (cursor["epoch"], cursor["position"], cursor["examples_seen"]) == (1, rows, 2 * rows)
    if rows % 4:
        return
    train_locally(spec(2, "reference"), base=tiny_base, progress=False)
    ours, theirs = adapter_tensors(tmp_path / "out/grpo"), adapter_tensors(tmp_path / "reference/grpo")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert _state(tmp_path / "out/grpo")["cursor"] == _state(tmp_path / "reference/grpo")["cursor"]
    rewards = [[json.loads(line)["reward"] for line in (tmp_path / folder / "grpo/metrics.jsonl").read_text()
                .splitlines()] for folder in ("out", "reference")]
    assert rewards[0] == rewards[1]
