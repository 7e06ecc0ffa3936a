"""The `aspen` command line's arguments: one parser, each command's options beside the handler that runs it."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from actors.spec.base_settings import QUANTIZATIONS
from orchestrator.run_plan import OVERWRITE_HELP

if TYPE_CHECKING:
    pass
from orchestrator.cli.export_commands import cmd_demo, cmd_export
from orchestrator.cli.run_commands import cmd_run
from orchestrator.cli.service_commands import (
    cmd_cancel,
    cmd_extend,
    cmd_generations,
    cmd_http,
    cmd_losses,
    cmd_pause,
    cmd_report,
    cmd_resume,
    cmd_serve,
    cmd_status,
    cmd_stop,
    cmd_submit,
    cmd_try,
    cmd_watch,
)
from orchestrator.cli.sweep_commands import cmd_sweep


def _step_tokens(value: str) -> int | str:
    """--step-tokens: a number of tokens, or auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is neither a number of tokens nor auto") from None


def with_json(command: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
    command.add_argument("--json", action="store_true", help=f"print {what} as JSON")
    return command


def with_from(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
    command.add_argument("--from", dest="from_dir", help="a run's output folder: its job table as the run left it "
                         "(default where no service runs: the newest `aspen run` on this machine)")
    return command


def with_address(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
    command.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                         help="Ray cluster (default: $RAY_ADDRESS or the cluster on this machine)")
    return command

def with_url(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
    command.add_argument("--url", default=os.environ.get("ASPEN_URL"),
                         help="talk to the service through its HTTP API at this URL (`aspen http`), without Ray "
                              "(default: $ASPEN_URL; the token from $ASPEN_TOKEN or ~/.aspen/http-token)")
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aspen", description="Fine-tune many LoRA adapters at once on one "
                                     "shared, frozen base model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="on an error, also print its traceback (aspen watch "
                        "--events: and the MQTT client's log)")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_service_commands(commands)
    _add_job_commands(commands)
    _add_run_commands(commands)
    return parser


def _add_service_commands(commands: Any) -> None:
    """serve, http, http-token, users."""
    serve = with_address(commands.add_parser("serve", help="start the service on the Ray cluster and return"))
    serve.add_argument("--config", help="service YAML (state_dir, trainers, policy)")
    serve.add_argument("--state-dir", help="where the job table and outputs live (default ~/.aspen)")
    serve.add_argument("--base-model", help="one kind of trainer with this base model (default smollm2-135m)")
    serve.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    serve.add_argument("--cpu-trainers", type=int, help="how many trainers of that kind (spread over the cluster)")
    serve.add_argument("--per-node", type=int, help="trainers of that kind on every node of the cluster, following "
                                                     "nodes as they join and leave")
    serve.add_argument("--step-tokens", type=_step_tokens, default="auto",
                       help="token budget of one fused step, or auto (default: 1024 on CPU, up to 8192 on a GPU by "
                            "the memory model)")
    serve.add_argument("--policy", help="scheduling policy: adaptive (default), fifo, sjf, priority, minpad, "
                                        "module:Class or an installed entry point (group aspen.policies)")
    serve.add_argument("--output-root", help="submitted jobs write only under this folder or storage URI, e.g. "
                       "s3://bucket/aspen (default: <state dir>/outputs)")
    serve.add_argument("--insecure", action="store_true", help="start the service even on a Ray cluster without "
                       "token authentication (by default refused: anyone who reaches such a cluster runs code on it)")
    serve.add_argument("--http", action="store_true", help="then serve the HTTP API in this process (as `aspen "
                       "http`) until Ctrl-C; the service keeps running after")
    serve.add_argument("--http-host", default="127.0.0.1", help="with --http: the address to bind (default loopback)")
    serve.add_argument("--http-port", type=int, default=8765, help="with --http: the port (default 8765)")
    with_json(serve, "the running service's description (trainers, URLs, state dir)")
    serve.set_defaults(handler=cmd_serve)

    http = with_address(commands.add_parser("http", help="serve the HTTP API of the running service (submit, list, "
                                                       "status, cancel, losses, events; token auth) until Ctrl-C"))
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                      "another one is warned about)")
    http.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    http.add_argument("--token-file", help="the bearer token's file (default ~/.aspen/http-token, generated with mode "
                      "0600 where missing)")
    http.add_argument("--state-dir", default=None,
                      help="the folder of the users file (`aspen user add`) and the audit log (default: the service's "
                           "own state folder, which it is asked for)")
    http.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    http.add_argument("--ssl-keyfile", help="and this private key (PEM)")
    http.set_defaults(handler=cmd_http)

    http_token = commands.add_parser("http-token", help="print the HTTP API's bearer token (generated where missing)")
    http_token.add_argument("--token-file", help="default ~/.aspen/http-token")
    http_token.add_argument("--state-dir", default="~/.aspen",
                            help="the service's state folder: where a users file is in force, the token is printed "
                                 "only while an admin holds it (default ~/.aspen)")
    http_token.add_argument("--rotate", action="store_true", help="replace it with a new token (restart `aspen http`)")
    from orchestrator.cli import user_commands

    http_token.set_defaults(handler=user_commands.cmd_http_token)
    user_commands.add_parser(commands)



def _add_job_commands(commands: Any) -> None:
    """losses, generations, try, submit, status, watch, report, cancel, pause, resume, stop."""
    losses = with_url(with_address(commands.add_parser("losses", help="a job's loss history: one row per optimizer "
                                                                    "step (loss, eval loss, a GRPO job's reward, a "
                                                                    "preference job's margin, lr, grad norm, "
                                                                    "tokens)")))
    with_from(losses)
    losses.add_argument("job", help="job id (or a unique job name)")
    with_json(losses, "the rows")
    losses.set_defaults(handler=cmd_losses)

    generations = with_url(with_address(commands.add_parser(
        "generations", help="what a job's adapter wrote at an eval_generate evaluation: each held-out prompt, its "
                            "reference, the prediction and its score (the last evaluation, or --step N)")))
    with_from(generations)
    generations.add_argument("job", help="job id (or a unique job name)")
    generations.add_argument("--step", type=int, help="the evaluation after this step (default: the last)")
    with_json(generations, "the evaluation (steps, step, rows)")
    generations.set_defaults(handler=cmd_generations)

    try_it = with_url(with_address(commands.add_parser(
        "try", help="a prompt continued greedily by a job's adapter (a running job's current one, a finished job's "
                    "final one) and by the base alone, side by side, on a trainer of the running service")))
    try_it.add_argument("job", help="job id (or a unique job name)")
    try_it.add_argument("prompt", help="the text to continue (the job's own prompt template is not applied)")
    try_it.add_argument("--max-new-tokens", type=int, default=64, help="new tokens at most (1-256, default 64)")
    with_json(try_it, "the answer (job, step, adapter, base, token counts, seconds)")
    try_it.set_defaults(handler=cmd_try)

    submit = with_url(with_address(commands.add_parser("submit", help="submit the jobs of a jobs YAML file")))
    submit.add_argument("file")
    with_json(submit, "the submitted jobs' ids and names")
    submit.set_defaults(handler=cmd_submit)

    status = with_url(with_address(commands.add_parser("status", help="all jobs, or one job in detail")))
    with_from(status)
    status.add_argument("job", nargs="?", help="job id (or a unique job name)")
    with_json(status, "the jobs (one job: with its state history)")
    status.set_defaults(handler=cmd_status)

    watch = with_address(commands.add_parser("watch", help="a live table of the jobs: state, step, loss, tokens/s, "
                                                         "ETA (Ctrl-C to leave)"))
    watch.add_argument("--once", action="store_true", help="print the table once and exit")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    watch.add_argument("--events", action="store_true", help="instead of the table: one line per job state change "
                       "and job event as the service publishes them over MQTT (its embedded broker's read-only "
                       "account, from the service's state dir; Ctrl-C to leave)")
    watch.add_argument("--state-dir", help="with --events: the service's state dir to read the MQTT reader account "
                       "from (default: ask the service for it)")
    watch.add_argument("--config", metavar="SERVICE_YAML", help="with --events: the service's YAML (aspen serve "
                       "--config): follow the broker its events: section names, connecting as the service does "
                       "(an external mqtt:// or mqtts:// broker: its URL, account and ca_file)")
    watch.add_argument("--progress", action="store_true", help="with --events: also a line per optimizer step")
    watch.add_argument("--reconnect-for", type=float, metavar="SECONDS", help="with --events: how long to keep "
                       "reconnecting to a broker that went away (a restart) before exiting 2 (default 300)")
    with_json(watch, "with --once: the jobs; with --events: one JSON object per event (topic, retained, payload)")
    watch.set_defaults(handler=cmd_watch)

    report = commands.add_parser("report", help="loss curves (report.png) and a summary table (report.md) of "
                                                "a run's jobs")
    report.add_argument("run_dir", nargs="?", help="a run's output folder (one folder per job) or a service's state "
                                                   "folder (default: the newest `aspen run` on this machine)")
    with_json(report, "each job's numbers and loss curve (no files written)")
    report.set_defaults(handler=cmd_report)

    cancel = with_url(with_address(commands.add_parser("cancel", help="cancel a job (it is checkpointed first)")))
    cancel.add_argument("job")
    with_json(cancel, "the job's record")
    cancel.set_defaults(handler=cmd_cancel)

    pause = with_url(with_address(commands.add_parser("pause", help="pause a job (it is checkpointed; `aspen "
                                                                  "resume` continues it)")))
    pause.add_argument("job")
    with_json(pause, "the job's record")
    pause.set_defaults(handler=cmd_pause)

    resume = with_url(with_address(commands.add_parser("resume", help="queue a paused, failed or cancelled job "
                                                                    "again; it continues from its last checkpoint")))
    resume.add_argument("job")
    with_json(resume, "the job's record")
    resume.set_defaults(handler=cmd_resume)

    extend = with_url(with_address(commands.add_parser(
        "extend", help="continue an ended or paused job to a larger max_steps, epochs or both (from its last "
                       "checkpoint)")))
    extend.add_argument("job")
    extend.add_argument("--max-steps", type=int, help="its new budget of optimizer steps")
    extend.add_argument("--epochs", type=float, help="its new passes over its data (it trains on into its next epoch)")
    with_json(extend, "the job's record")
    extend.set_defaults(handler=cmd_extend)

    stop = with_address(commands.add_parser("stop", help="stop the service (jobs are checkpointed)"))
    stop.set_defaults(handler=cmd_stop)



def _add_run_commands(commands: Any) -> None:
    """run, sweep, export, demo: the commands that start what they need."""
    run = commands.add_parser("run", help="train every job of a jobs YAML file through a service of its own, "
                                          "with a progress bar per job")
    run.add_argument("file", help="jobs YAML file")
    run.add_argument("--output-dir", help="override output_dir of the file (a folder or a storage URI, "
                     "e.g. s3://bucket/runs/x)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    run.add_argument("--in-process", action="store_true", help="train in this process, without Ray")
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    run.set_defaults(handler=cmd_run)

    sweep = commands.add_parser("sweep", help="a sweep file's trials trained as jobs of a service of its own (or "
                                              "the running one: --address, --url), the weak ones stopped early; "
                                              "ends with the leaderboard. `aspen sweep status NAME|FOLDER`: a sweep's "
                                              "leaderboard; `aspen sweep cancel NAME`: cancel it")
    sweep.add_argument("target", nargs="+", metavar="FILE | status NAME | cancel NAME",
                       help="sweep YAML file (docs/sweeps.md), or `status` and a sweep's name (or its folder), or "
                            "`cancel` and a running sweep's name")
    sweep.add_argument("--address", help="a running service's Ray cluster (default: a service of the sweep's own)")
    sweep.add_argument("--url", help="a running service's HTTP API (`aspen http`)")
    sweep.add_argument("--from", dest="from_dir", help="with cancel: the output_dir of a sweep whose service is not "
                       "running (an interrupted `aspen sweep FILE`), cancelled in its folder's state")
    sweep.add_argument("--json", action="store_true", help="print the leaderboard as JSON")
    sweep.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the trials (default 1)")
    sweep.set_defaults(handler=cmd_sweep)

    export = with_address(commands.add_parser("export", help="write a job's adapter as a PEFT folder (vLLM "
                                                             "--lora-modules), or merged into its base (--merge)"))
    export.add_argument("job", help="the job's folder, or its id or name (in --from DIR, else in the service)")
    export.add_argument("--out", help="the folder to write (default ./<job>-lora, with --merge ./<job>-merged)")
    export.add_argument("--merge", action="store_true", help="the base with the adapter merged, as a transformers "
                        "folder (config.json, model.safetensors, tokenizer)")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    export.add_argument("--from", dest="from_dir", help="a run's output folder or a service's state folder to find "
                        "JOB in (without it, a JOB that is not a folder is looked up in the running service)")
    export.add_argument("--checkpoint", action="store_true", help="export the job's last checkpoint instead of its "
                        "final adapter (e.g. of a job still running)")
    export.add_argument("--base", help="with --merge: load the base from here (a folder, a .gguf file, a cached hub "
                        "id) instead of where the job trained on it")
    export.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="with --merge: the merged weights' dtype (auto: the base's)")
    with_url(export)
    with_json(export, "the folder written")
    export.set_defaults(handler=cmd_export)

    demo = commands.add_parser("demo", help="train 4 small generated tasks on smollm2-135m and show accuracy")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per job")
    demo.add_argument("-q", "--quiet", action="store_true")
    demo.set_defaults(handler=cmd_demo)
