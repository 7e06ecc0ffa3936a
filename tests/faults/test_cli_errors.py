"""The `aspen` command never shows a traceback for a user error or an unreachable cluster: one line that
says what happened and what to do, exit 2 for bad usage or a bad jobs file, exit 1 for a runtime failure,
and `--debug` for the traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.ports import free_port


def aspen(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


JOBS = """\
base_model: smollm2-135m
output_dir: out
jobs:
  - name: job-a
    data: data.jsonl
    format: {type: prompt_response, prompt: "{q}", response: " {a}"}
    lr: LR
    max_steps: 5
"""


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "data.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    return tmp_path


@pytest.mark.parametrize("lr, expected", [(".inf", "lr: must be a finite number greater than 0 and at most 10 "
                                                    "(got inf)"),
                                           ('"fast"', "lr: Input should be a valid number")])
def test_a_bad_jobs_file_is_one_message_and_exit_2(folder, lr, expected):
    (folder / "jobs.yaml").write_text(JOBS.replace("LR", lr))
    result = aspen("run", "jobs.yaml", cwd=folder)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert "jobs.yaml:7: job 'job-a' (jobs[0]), field " + expected in result.stderr, result.stderr


def test_a_missing_jobs_file_and_bad_usage_exit_2(folder):
    result = aspen("run", "nothere.yaml", cwd=folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nothere.yaml" in result.stderr
    result = aspen("run", cwd=folder)                  # argparse: missing argument
    assert result.returncode == 2 and "Traceback" not in result.stderr
    result = aspen("watch", "--state-dir", "x", cwd=folder)   # a flag that needs another one
    assert result.returncode == 2
    assert "--state-dir, --config, --progress and --reconnect-for go with --events" in result.stderr


def test_an_unreachable_cluster_is_one_line_and_exit_1(folder):
    port = free_port()
    result = aspen("status", "--address", f"127.0.0.1:{port}", cwd=folder)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "ray start --head" in lines[0], lines


def test_debug_shows_the_traceback(folder):
    result = aspen("--debug", "status", "--address", f"127.0.0.1:{free_port()}", cwd=folder)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ServiceError" in result.stderr


def test_ctrl_c_while_connecting_is_one_line_and_exit_130(folder):
    """SIGINT while the command waits on something: no traceback."""
    script = textwrap.dedent("""
        import os, signal, sys, threading
        from orchestrator.cli import main, parser
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        def slow(args):
            import time
            time.sleep(30)
            return 0
        parser.cmd_status = slow
        sys.exit(main(["status"]))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result
    assert "Traceback" not in result.stderr and "interrupted" in result.stderr, result.stderr


def test_a_cluster_that_refuses_this_process_is_said_not_covered_by_an_ended_runs_table(tmp_path, monkeypatch,
                                                                                      capsys):
    """A Ray cluster that answers here and refuses this process's token (a head started with token authentication,
    a client without RAY_AUTH_MODE=token): `aspen status` says so and what to set, rather than answering from the
    newest ended `aspen run`'s table as if no service ran; `--from` still reads that table, as asked, without
    claiming that no service runs."""
    from actors.service.table.job_table import JobTable
    from orchestrator.cli.main import main
    from orchestrator.errors import ClusterRefused, ServiceError
    from orchestrator.recent_runs import RecentRuns, state_folder

    out_dir = tmp_path / "run"
    JobTable(state_folder(out_dir) / "jobs.sqlite").close()
    monkeypatch.setenv("ASPEN_RECENT_RUNS", str(tmp_path / "runs.json"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    RecentRuns().remember(tmp_path / "jobs.yaml", str(out_dir), state_folder(out_dir))
    refusal = ("Failed to connect to Ray cluster at 10.0.0.5:6379 (RPC error: InvalidAuthToken); if it is your "
               "service's cluster and uses token authentication, this process needs its token and "
               "RAY_AUTH_MODE=token")

    def refused(args):
        raise ClusterRefused(refusal)

    monkeypatch.setattr("orchestrator.cli.service_commands.connect_service", refused)
    assert main(["status"]) == 1
    error = capsys.readouterr().err
    assert refusal in error and "the job table of the run" not in error, error
    assert main(["status", "--from", str(out_dir)]) == 0
    error = capsys.readouterr().err
    assert "the job table of the run in" in error and "no aspen service is running" not in error, error

    def no_cluster(args):
        raise ServiceError("no running Ray cluster found")

    monkeypatch.setattr("orchestrator.cli.service_commands.connect_service", no_cluster)
    assert main(["status"]) == 0   # none there at all: the ended run answers, said so
    assert "no aspen service is running; the job table of the run in" in capsys.readouterr().err


def test_a_refusal_says_the_fix_for_what_this_process_has(tmp_path, monkeypatch):
    """The refusal's fix by the client's own state: a token file and no RAY_AUTH_MODE=token (a head started on this
    machine after `aspen run` made the token): set RAY_AUTH_MODE; no token at all: get the head's and set both. (A
    token sent and refused, another cluster's: tests/service/test_ray_job_submit.py against a real head.)"""
    from orchestrator.ray_cluster import _refusal_fix

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    without = _refusal_fix()
    assert "needs its token (copy the head's ~/.ray/auth_token or set RAY_AUTH_TOKEN) and RAY_AUTH_MODE=token" \
        in without, without
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a" * 64)
    unsent = _refusal_fix()
    assert "has a token" in unsent and "does not send it: set RAY_AUTH_MODE=token" in unsent, unsent


def test_a_ray_token_other_users_can_read_is_warned_of(tmp_path):
    """`aspen serve` warns where ~/.ray/auth_token is readable by other local users (as `ray get-auth-token
    --generate` writes it under umask 022): the warning names the file, its mode and the chmod; a private or
    absent token says nothing."""
    import os

    from orchestrator.cluster_auth import exposed_token_file

    token = tmp_path / "auth_token"
    assert exposed_token_file(token) is None   # absent
    token.write_text("a" * 64)
    for mode, exposed in ((0o644, True), (0o640, True), (0o604, True), (0o600, False), (0o400, False)):
        os.chmod(token, mode)
        warning = exposed_token_file(token)
        assert (warning is not None) == exposed, (oct(mode), warning)
        if exposed:
            assert f"(mode {mode:o})" in warning and f"chmod 600 {token}" in warning, warning


@pytest.mark.parametrize("in_process", [False, True])
def test_an_output_dir_that_cannot_be_a_folder_names_the_file_line_and_field(folder, in_process):
    """output_dir a file, or a path under a file: `aspen run` (through its service or in process) stops before
    anything starts with the jobs file's line and field, exit 2 (it was a bare OSError, `[Errno 20] Not a directory:
    '.../.aspen'`, exit 1 through the service after starting it, naming neither the file nor output_dir); such an
    --output-dir is said as the command line's, not as an invalid jobs file."""
    (folder / "taken").write_text("a file where the run's folder goes\n")
    extra = ["--in-process"] if in_process else []
    for output, why in (("taken", f"{folder / 'taken'} is a file, not a folder"),
                        ("taken/run", f"{folder / 'taken'} is a file, not a folder")):
        (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("output_dir: out",
                                                                                f"output_dir: {output}"))
        result = aspen("run", *extra, "jobs.yaml", cwd=folder)
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr
        assert (f"jobs.yaml:2: output_dir: the run's folder {folder / output} cannot be created or written" in
                result.stderr and why in result.stderr and "--output-dir" in result.stderr), result.stderr
    result = aspen("run", *extra, "jobs.yaml", "--output-dir", str(folder / "taken" / "x"), cwd=folder)
    assert result.returncode == 2 and f"--output-dir: the run's folder {folder / 'taken' / 'x'}" in result.stderr, \
        result.stderr
    # the command line's, not the jobs file's: it was said under "invalid jobs file:", with the file's output_dir
    assert "invalid jobs file" not in result.stderr and "give --output-dir a folder you can write" in result.stderr, \
        result.stderr
    assert (folder / "taken").read_text() == "a file where the run's folder goes\n"
    assert not any(path.is_dir() for path in folder.iterdir())   # no folder made by the refusals


@pytest.mark.parametrize("in_process", [False, True])
def test_a_file_where_a_jobs_folder_goes_is_said_before_anything_starts(folder, in_process):
    """`output_dir/<job>` a file: exit 2 before anything starts, saying a file is in the way, its path, the job's line
    and what to do, not under "invalid jobs file"; the job started, and failed saying "make the folder writable"."""
    (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4"))
    (folder / "out").mkdir()
    (folder / "out" / "job-a").write_text("notes\n")
    result = aspen("run", *(["--in-process"] if in_process else []), "jobs.yaml", cwd=folder,
                   env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"})   # a run that started its service fails on it
    assert result.returncode == 2, result
    assert (f"jobs.yaml:4: job 'job-a' (jobs[0]): a file is in the way of its folder: {folder / 'out' / 'job-a'} is a "
            "file" in result.stderr and "move or delete the file" in result.stderr), result.stderr
    assert "invalid jobs file" not in result.stderr and "writable" not in result.stderr, result.stderr
    assert (folder / "out" / "job-a").read_text() == "notes\n" and list((folder / "out").iterdir()) == [
        folder / "out" / "job-a"]


def closed_output(*args: str, cwd: Path) -> tuple[int, str]:
    """`aspen ARGS` with stdout a pipe its reader closed before reading (`| head -0`): exit code, stderr."""
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    _, err = process.communicate(timeout=300)
    return process.returncode, err


def test_output_to_a_closed_pipe_ends_quietly_and_a_run_says_how_it_continues(tmp_path, tiny_model_dirs):
    """The reader of aspen's output gone (`| head`): exit 1, as rich ends a table printed there; a command that only
    prints says nothing more, a run says it stopped and that the same command continues. A plain line printed there
    said "aspen: [Errno 32] Broken pipe" (`aspen run` through its service stopped so, its jobs checkpointed but not
    said to be)."""
    from tests.helpers.interrupted_runs import NO_RAY, write_run

    write_run(tmp_path, tiny_model_dirs["llama"], steps=3)
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "--quiet", "jobs.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=NO_RAY)
    assert done.returncode == 0, done
    for command in (["report", "out"], ["losses", "first", "--from", "out"], ["status", "--from", "out"]):
        code, err = closed_output(*command, cwd=tmp_path)
        assert code == 1 and "Broken pipe" not in err and "Errno" not in err and "Exception" not in err, (code, err)
    code, err = closed_output("run", "--in-process", "jobs.yaml", cwd=tmp_path)   # its first line: "first: already..."
    assert code == 1 and "aspen: stopped: the pipe its output went to was closed" in err, (code, err)
    assert "the same command continues" in err and "Broken pipe" not in err, err


def test_a_device_this_machine_has_not_is_refused_at_its_line_before_anything_starts(folder):
    """`device:` a CUDA GPU the machine has not (counted here by torch itself): `aspen run --in-process` failed in
    torch with "AssertionError: Torch not compiled with CUDA enabled" (exit 1, no file, line or field), and `aspen
    run` through its own Ray waited for ever at "trainer-0: starting its process"; a value that is no device (gpu)
    was torch's RuntimeError listing its device types. Now each is exit 2 at the file's line of `device`, nothing
    started."""
    import signal

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}   # `aspen run`'s own Ray
    runs = [(f"cuda:{count}", ["--in-process"])] + ([("cuda", [])] if count == 0 else [])
    for device, extra in runs:
        (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("output_dir: out\n",
                                                                                f"output_dir: out\ndevice: {device}\n"))
        process = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", *extra, "jobs.yaml"], cwd=folder,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)   # `aspen run` stops its Ray on SIGTERM
            _, stderr = process.communicate(timeout=120)
            pytest.fail(f"aspen run {' '.join(extra)} with device: {device} still ran after 120 s: {stderr[-2000:]}")
        assert process.returncode == 2 and "Traceback" not in stderr, (device, stderr)
        assert f"jobs.yaml:3: device: {device}, but this machine has " in stderr, stderr
        assert "set device: auto" in stderr and "nothing was started" in stderr, stderr
        assert not (folder / "out").exists(), "the run started"
    (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("output_dir: out\n",
                                                                            "output_dir: out\ndevice: gpu\n"))
    result = aspen("run", "--in-process", "jobs.yaml", cwd=folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    assert "jobs.yaml:3: device: 'gpu' is not one of auto, cpu, cuda or cuda:N" in result.stderr, result.stderr


def test_a_pipeline_the_bases_decoder_cannot_take_is_refused_at_its_line_before_anything_starts(tmp_path,
                                                                                                tiny_model_dirs):
    """`stage_split` counts that do not sum to the base's decoder layers, or more `stages` than its layers (counted by
    transformers' own config of the base): `aspen run` started its Ray and trainer, which died on it ('no trainer
    could start', a remote traceback, exit 1, no file or line); now exit 2 at the file's line, nothing started."""
    from transformers import AutoConfig

    base = tiny_model_dirs["llama"]
    layers = AutoConfig.from_pretrained(base).num_hidden_layers
    (tmp_path / "data.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}   # `aspen run`'s own Ray
    split_said = f"jobs.yaml:4: stage_split [1, {layers + 3}] holds {layers + 4} decoder layers and base {base} has "
    stages_said = f"jobs.yaml:3: stages: {layers + 1} for base {base}'s decoder of {layers} layers"
    for settings, extra, expected in ((f"stages: 2\nstage_split: [1, {layers + 3}]", [], f"{split_said}{layers}"),
                                      (f"stages: {layers + 1}", ["--in-process"], stages_said)):
        (tmp_path / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("smollm2-135m", str(base)).replace(
            "output_dir: out\n", f"output_dir: out\n{settings}\n"))
        result = aspen("run", *extra, "jobs.yaml", cwd=tmp_path, env=env)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result
        assert expected in result.stderr and "nothing was started" in result.stderr, result.stderr
        assert not (tmp_path / "out").exists(), "the run started"


def test_gpu_only_settings_on_a_machine_without_a_gpu_are_refused_at_their_line(folder):
    """kernels: liger and compile: graphs on a machine whose torch sees no CUDA GPU: `aspen run` started its Ray and a
    trainer that died on it ('no trainer could start', a remote traceback, exit 1), in-process a line without the
    file's; now exit 2 at the field's line, nothing started."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        pytest.skip("this machine has a CUDA GPU: both settings run here")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}   # `aspen run`'s own Ray
    for setting, extra in (("kernels: liger", []), ("compile: graphs", ["--in-process"])):
        (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("output_dir: out\n",
                                                                                f"output_dir: out\n{setting}\n"))
        result = aspen("run", *extra, "jobs.yaml", cwd=folder, env=env)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result
        field = setting.split(":")[0]
        assert f"jobs.yaml:3: {setting} " in result.stderr and "this machine has no CUDA GPU" in result.stderr, \
            result.stderr
        assert f"(nothing was started: fix {field}, then run again)" in result.stderr, result.stderr
        assert not (folder / "out").exists(), "the run started"


def test_a_micro_batch_over_autos_limit_says_auto_not_a_step_tokens_the_file_lacks(folder):
    """A job too large for a step, in a file that leaves step_tokens to auto: the refusal said 'exceeds step_tokens
    4096', a value the file does not hold; it now says auto's limit, and a set step_tokens as before."""
    for setting, said in (("", "exceeds 4096, the most one micro-batch may take with step_tokens: auto"),
                          ("step_tokens: 2048\n", "exceeds step_tokens 2048 (")):
        (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace(
            "output_dir: out\n", f"output_dir: out\n{setting}").replace("max_steps: 5", "max_seq_len: 1025"))
        result = aspen("run", "--in-process", "jobs.yaml", cwd=folder)
        assert result.returncode == 2 and "field max_seq_len: batch_size 4 * max_seq_len 1025 = 4100" in result.stderr
        assert said in result.stderr and "raise step_tokens to at least 4100" in result.stderr, result.stderr


def test_a_dataset_whose_store_does_not_answer_names_its_job(folder):
    """A job's data under a storage URI whose endpoint does not answer (nothing listens on its port): `aspen run`
    said the URI and the fix, but not which job's data it was; now 'job NAME: the dataset ...', still exit 1 (not the
    file's fault: run again once the store answers), nothing started."""
    (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4").replace("data: data.jsonl",
                                                                            "data: s3://bucket/data.jsonl"))
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1"}
    result = aspen("run", "--in-process", "jobs.yaml", cwd=folder, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result
    assert "job 'job-a': the dataset s3://bucket/data.jsonl" in result.stderr, result.stderr
    assert "the storage endpoint cannot be reached" in result.stderr and "AWS_ENDPOINT_URL_S3" in result.stderr
    assert not (folder / "out" / "job-a").exists(), "the job started"


def test_a_run_refused_before_it_starts_leaves_no_run_folder_and_a_second_run_says_the_same(folder):
    """`aspen run --in-process` refused for a bad row: it left `out/.aspen/scheduler.lock` (the folder it had locked),
    an output folder of a run that never ran; now the folders it made are gone again, and the same run again is
    refused for the row, not for a lock. A folder that held only an older run's stale lock file is left usable."""
    (folder / "data.jsonl").write_text('{"q": "1+1", "a": "2"}\n{"q": "2+2"}\n')
    (folder / "jobs.yaml").write_text(JOBS.replace("LR", "1.0e-4"))
    for _ in range(2):
        result = aspen("run", "--in-process", "jobs.yaml", cwd=folder)
        assert result.returncode == 2 and "data.jsonl:2" in result.stderr, result.stderr
        assert "another aspen run" not in result.stderr, result.stderr
        assert sorted(path.name for path in folder.iterdir()) == ["data.jsonl", "jobs.yaml"]
    (folder / "out" / ".aspen").mkdir(parents=True)
    (folder / "out" / ".aspen" / "scheduler.lock").write_text("pid 1 on another-host\n")   # as an older aspen left it
    result = aspen("run", "--in-process", "jobs.yaml", cwd=folder)
    assert result.returncode == 2 and "data.jsonl:2" in result.stderr, result.stderr
    assert list((folder / "out").iterdir()) == [folder / "out" / ".aspen"]   # not made by this run: kept
    assert list((folder / "out" / ".aspen").iterdir()) == []
