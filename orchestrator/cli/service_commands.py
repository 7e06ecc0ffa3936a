"""The commands that talk to a running service: serve, http, losses, generations, submit, status (or an
ended run's table), watch, report, cancel / pause / resume, extend, stop."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from actors.storage.storage_uri import as_location
from orchestrator import strict_json

if TYPE_CHECKING:
    pass


def _service_config(args: argparse.Namespace):
    import yaml

    from actors.service.scheduler.config import ServiceConfig, TrainerConfig
    from orchestrator.service_yaml import resolve_service_paths

    data: dict = {}
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if isinstance(data, dict):   # its relative paths from its folder (else ServiceConfig says what is wrong)
            resolve_service_paths(data, args.config)
    if args.state_dir:
        data["state_dir"] = args.state_dir
    if args.policy:
        data["policy"] = args.policy
    if args.output_root:
        data["output_root"] = args.output_root
    if args.cpu_trainers and args.per_node:
        raise SystemExit("aspen serve: give --cpu-trainers (trainers anywhere on the cluster) or --per-node "
                         "(trainers on every node), not both")
    if args.base_model or args.cpu_trainers or args.per_node:
        trainer = {"base_model": args.base_model or "smollm2-135m", "count": args.cpu_trainers or args.per_node or 1,
                   "nodes": "each" if args.per_node else "any",
                   "quantization": args.quantization, "step_tokens": args.step_tokens}
        data["trainers"] = [TrainerConfig.model_validate(trainer).model_dump()]
    return ServiceConfig.model_validate(data)


def connect_service(args: argparse.Namespace):
    """The service's client: over the HTTP API with --url (or $ASPEN_URL; no Ray needed), else over Ray."""
    if getattr(args, "url", None):
        from orchestrator.http.api_client import HttpClient

        return HttpClient(args.url)
    from orchestrator.client import Client

    return Client.connect(args.address)


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.client import Client
    from orchestrator.cluster_auth import exposed_token_file
    from orchestrator.machine_budget import budgets_over_machine, cluster_is_this_machine
    from orchestrator.progress import wait_for_trainers

    config = _service_config(args)
    # a budget this machine cannot hold, on this machine's cluster: refused before Ray is joined (machine_budget.py)
    if cluster_is_this_machine(args.address) and (over := budgets_over_machine(config, args.config or "aspen serve")):
        raise SystemExit("aspen serve: " + "\naspen serve: ".join(over))
    client = Client.serve(config, address=args.address, insecure=args.insecure)
    # what each trainer does as it starts, on stderr (a trainer waiting for a node an autoscaler may add, said once);
    # one no node holds, where no autoscaler may add one, is not waited for: the service stays up and starts it once
    # a node that has it joins, as a `nodes: each` kind's (exit 0, NOT PLACED / trainers error said below;
    # ServiceError, exit 1, only where each trainer failed: docs/cluster.md)
    info = wait_for_trainers(client, out=sys.stderr, warn=False, nodes_may_join=True)
    exposed = exposed_token_file()
    if exposed:
        print(f"aspen: warning: {exposed}", file=sys.stderr)
    if args.json:
        print(strict_json.dumps(info, indent=1, default=str))
        return 0
    print(f"aspen service running (state in {info['state_dir']}, policy {info['policy']})")
    if info.get("output_root"):
        print(f"  jobs write under {info['output_root']}")
    if info.get("mqtt_url"):
        print(f"  job events: {info['mqtt_url']} (topics {info.get('mqtt_topics', 'aspen/v1/#')})")
    if info.get("mqtt_credentials"):
        print(f"  job events' read-only account: {info['mqtt_credentials']} (`aspen watch --events` reads it)")
    for trainer in info["trainers"]:
        where = trainer.get("device", "?") + (f" of node {trainer['node_address']}" if trainer.get("node_address")
                                              else "")
        print(f"  {trainer['id']}: {trainer['base_model']} ({trainer['quantization']}) on {where}"
              + (f"  ERROR: {trainer['error']}" if trainer.get("error") else "")
              + (f"  NOT PLACED: {trainer['phase']}" if trainer.get("unplaceable") else ""))
    for key, value in info.items():   # what the service's listeners report: metrics_url, metrics_error, ...
        if key.endswith(("_url", "_error")):
            print(f"  {key.replace('_', ' ')}: {value}")
    if args.http:
        import ray

        from orchestrator.http.api import serve

        ray.shutdown()   # the service is detached; the API reaches it from a process of its own (http_bridge)
        serve(address=args.address, host=args.http_host, port=args.http_port, state_dir=info["state_dir"])
    return 0


def cmd_http(args: argparse.Namespace) -> int:
    from orchestrator.http.api import serve

    serve(address=args.address, host=args.host, port=args.port, token_file=args.token_file,
          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, state_dir=args.state_dir)
    return 0


def cmd_losses(args: argparse.Namespace) -> int:
    rows = _service_or_ended_run(args).losses(args.job)
    if args.json:
        print(strict_json.dumps(rows, indent=1))
        return 0
    fmt = lambda v, spec=".4f": "-" if v is None else format(v, spec)  # noqa: E731 - a formatter local to this table
    # optional columns: a job with eval_generate, a GRPO job's mean reward, a preference job's reward margin
    extra = [(key, title) for key, title in (("eval_score", "eval score"), ("reward", "reward"),
                                             ("rewards/margins", "margin"))
             if any(row.get(key) is not None for row in rows)]
    print(f"{'step':>6}{'loss':>10}{'eval loss':>11}" + "".join(f"{title:>12}" for _, title in extra)
          + f"{'lr':>11}{'grad norm':>11}{'tokens':>9}")
    for row in rows:
        print(f"{row['step']:>6}{fmt(row['loss']):>10}{fmt(row['eval_loss']):>11}"
              + "".join(f"{fmt(row.get(key)):>12}" for key, _ in extra)
              + f"{fmt(row['lr'], '.3g'):>11}{fmt(row['grad_norm'], '.3g'):>11}{fmt(row['tokens'], 'd'):>9}")
    return 0


def cmd_try(args: argparse.Namespace) -> int:
    """"Try it": the prompt continued greedily by the job's adapter (a running job's current one, a finished job's
    final one) and by the base alone, on a trainer of the running service."""
    answer = connect_service(args).generate(args.job, args.prompt, args.max_new_tokens)
    if args.json:
        print(strict_json.dumps(answer, indent=1))
        return 0
    ended = "the first new token ended the answer"
    print(f"{answer['job']} (step {answer['step']}), {answer['prompt_tokens']} prompt tokens, {answer['seconds']} s")
    print(f"-- with the adapter ({answer['new_tokens'][0]} new tokens):\n{answer['adapter'] or '(' + ended + ')'}")
    print(f"-- the base alone ({answer['new_tokens'][1]} new tokens):\n{answer['base'] or '(' + ended + ')'}")
    return 0


def cmd_generations(args: argparse.Namespace) -> int:
    """An eval_generate evaluation's rows: what the adapter wrote for each held-out prompt, against the reference,
    with its score (the last evaluation, or the one after --step)."""
    from rich.markup import escape
    from rich.table import Table

    from orchestrator.progress import print_table

    found = _service_or_ended_run(args).generations(args.job, args.step)
    if args.json:
        print(strict_json.dumps(found, indent=1))
        return 0
    kept = _kept_generations(args.job, found)
    if found["step"] is None:
        print(f"{args.job}: no generations (a job with eval_generate writes them at each of its evaluations)")
        if kept:
            print(kept)
        return 0
    scores = [row["score"] for row in found["rows"] if isinstance(row.get("score"), (int, float))]
    mean = f", mean score {sum(scores) / len(scores):.4g}" if scores else ""
    steps = ", ".join(map(str, found["steps"]))
    title = f"{args.job}: the evaluation after step {found['step']} ({len(found['rows'])} rows{mean}; evaluated " \
            f"after steps {steps})"
    table = Table(title=escape(title), show_lines=True)
    for column in ("row", "prompt", "reference", "prediction", "score"):
        table.add_column(column, justify="right" if column in ("row", "score") else "left", overflow="fold")
    for row in found["rows"]:
        score = row.get("score")
        texts = (_clipped(row.get("prompt"), tail=True), _clipped(row.get("reference")),
                 _clipped(row.get("prediction")))
        table.add_row(str(row.get("row", "")), *map(escape, texts),   # texts as written, not markup
                      "-" if score is None else format(score, ".4g"))
    print_table(table)
    if kept:
        print(kept)
    return 0


def _kept_generations(job: str, found: dict) -> str | None:
    """For a keep_best job (`found["best"]`): which step's adapter it keeps, and where that step's generations are
    (these, `--step N`, or none recorded); None for another job."""
    from actors.service.table.job_record import best_text

    best = found.get("best")
    if best is None:
        return None
    step = best["step"]
    kept = f"{job} keeps the adapter of its best evaluation, {best_text(best)}"
    if found["step"] == step:
        return f"{kept}: these are its generations"
    if step in found["steps"]:
        return f"{kept}; its generations: aspen generations {job} --step {step}"
    return f"{kept}; no generations were recorded after step {step}"


def _clipped(text: str | None, *, tail: bool = False, limit: int = 400) -> str:
    """A long text's first `limit` characters, or with `tail` its last (a prompt's: what the adapter continued);
    the whole in --json."""
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if tail else text[:limit] + "..."


def cmd_submit(args: argparse.Namespace) -> int:
    from orchestrator.base_check import check_target_modules
    from orchestrator.jobs_file import load_run_spec

    # a `lora.target_modules` name the base has no layer of, where this machine has the base (else the service's
    # check says it), refused with the file's line before anything is submitted (and before a service is looked for)
    check_target_modules(load_run_spec(args.file, check_files=False, for_a_service=True), args.file, verb="submit")
    # a bad row or template refused before anything is submitted: over Ray by the client (Client.submit_run); over
    # the HTTP API (--url) by the API, where the data is (its paths are the service's machine's), each row read once
    handles = connect_service(args).submit_run(args.file)
    if args.json:
        print(strict_json.dumps([{"id": h.id, "name": h.name} for h in handles], indent=1))
        return 0
    for handle in handles:
        print(f"submitted {handle.id} ({handle.name})")
    return 0


def named_cluster(args: argparse.Namespace) -> bool:
    """Whether the command names a service (--url) or a cluster (--address or $RAY_ADDRESS), rather than
    whatever runs here."""
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS", "auto")
    return bool(getattr(args, "url", None)) or address != "auto"


def _ended_run_or(args: argparse.Namespace, error: Exception):
    """After a run's service ended: its job table (--from, else the newest `aspen run` of this machine), said
    so on stderr; else the error that found no service."""
    from orchestrator.recent_runs import EndedRun, RecentRuns, shown_folder, state_folder

    if args.from_dir:
        folder = state_folder(args.from_dir)
    else:
        run = RecentRuns().latest()
        if run is None:
            raise error
        folder = Path(run.state_dir)
    from actors.service.table.state_dir import live_holder

    why = "" if args.from_dir else "no aspen service is running; "   # --from: asked for, whether one runs or not
    holder = live_holder(folder)
    if holder is not None:   # a run still going, in another process: its table is not how it ended
        print(f"aspen: {why}the job table of the run in {shown_folder(folder)}, which is still going ({holder}), as "
              "it last recorded its jobs (an in-process run records them as they start and as it ends; each job's "
              f"steps so far are in its metrics.jsonl: `aspen report {shown_folder(folder)}`)", file=sys.stderr)
        return EndedRun(folder)
    print(f"aspen: {why}the job table of the run in {shown_folder(folder)} as it ended (`aspen run` of its jobs file "
          "resumes unfinished jobs)", file=sys.stderr)
    return EndedRun(folder)


def _service_or_ended_run(args: argparse.Namespace):
    """The running service; where none runs (and no cluster or URL is named), the ended run's table (`--from`, else
    the newest `aspen run` of this machine)."""
    from orchestrator.errors import ClusterRefused, ServiceError

    if args.from_dir and args.url:
        raise ValueError("give --from (a run's folder) or --url (a running service), not both")
    try:
        if args.from_dir:
            raise ServiceError("--from given")
        return connect_service(args)
    except ServiceError as error:   # no cluster, or no service on it: a run that has ended answers from its table
        if args.url or isinstance(error, ClusterRefused) or (not args.from_dir and named_cluster(args)):
            raise   # a cluster named and not there, or one there that refuses this process: an error
        return _ended_run_or(args, error)


def _status(client, args: argparse.Namespace):
    """The job's record; a running service's "no job" says where the job is if a run of this machine has it."""
    from orchestrator.recent_runs import EndedRun, where_else

    try:
        return client.status(args.job)
    except KeyError as error:
        if isinstance(client, EndedRun) or args.url:
            raise
        raise where_else(error, args.job) from None


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.progress import print_table, record_lines, summary_table

    client = _service_or_ended_run(args)
    if args.job:
        record = _status(client, args)
        if args.json:
            history = [{"time": when, "state": state, "reason": reason}
                       for when, state, reason in client.transitions(record.id)]
            print(strict_json.dumps({**record.as_dict(), "history": history}, indent=1))
            return 0
        print("\n".join(record_lines(record, client.transitions(record.id))))
        return 0
    records = client.jobs()
    if args.json:
        print(strict_json.dumps([r.as_dict() for r in records], indent=1))
    else:
        print_table(summary_table(records))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.client import Client
    from orchestrator.watch import watch

    if args.events:
        from orchestrator.mqtt.settings import config_settings, reader_settings
        from orchestrator.watch import MQTT_LOG, RECONNECT_FOR_S, watch_events

        if args.once:
            raise ValueError("--once shows the job table; --events follows the job events until Ctrl-C (use one)")
        if args.state_dir and args.config:
            raise ValueError("--state-dir reads the embedded broker's reader account, --config the service's YAML "
                             "(which names its state_dir): give one")
        if args.debug:
            MQTT_LOG.setLevel(logging.DEBUG)     # the MQTT client's own lines
        try:
            if args.config:
                settings = config_settings(args.config)
            elif args.state_dir:
                settings = reader_settings(args.state_dir)
            else:
                settings = Client.connect(args.address).event_settings()
            print(f"job events from {settings.url} (as {settings.username or 'no account'}, settings in "
                  f"{settings.source}); "
                  "Ctrl-C to leave", file=sys.stderr, flush=True)
            reconnect_for = RECONNECT_FOR_S if args.reconnect_for is None else args.reconnect_for
            watch_events(settings, progress=args.progress, as_json=args.json, reconnect_for=reconnect_for)
        except OSError as error:   # no or unreadable credentials, a refused or lost connection
            print(f"aspen: {error}", file=sys.stderr)
            return 2
        return 0
    if args.state_dir or args.config or args.progress or args.reconnect_for is not None:
        raise ValueError("--state-dir, --config, --progress and --reconnect-for go with --events")
    if args.json and not args.once:
        raise ValueError("--json goes with --once (the job table once, as JSON) or --events (one JSON object per "
                         "event); the live table has no JSON form")
    client = Client.connect(args.address)
    if args.json:
        print(strict_json.dumps([r.as_dict() for r in client.jobs()], indent=1))
        return 0
    console = Console(width=max(Console().width, 140)) if args.once and not sys.stdout.isatty() else Console()
    watch(client.jobs, once=args.once, interval=args.interval, console=console)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.report import collect, report_data, write_report

    if args.run_dir is None:
        from orchestrator.recent_runs import RecentRuns

        run = RecentRuns().latest()
        if run is None:
            raise ValueError("give a run's output folder (aspen report DIR): no `aspen run` on this machine is known")
        args.run_dir = run.output_dir
        print(f"aspen: the run in {run.output_dir} (the newest `aspen run` on this machine)", file=sys.stderr)
    if args.json:
        print(strict_json.dumps(report_data(collect(as_location(args.run_dir))), indent=1))
        return 0
    write_report(as_location(args.run_dir), console=Console(width=max(Console().width, 120)))
    return 0


def _job_command(verb: str, running_note: str):
    """`aspen cancel|pause|resume JOB`: the client's `verb` on one job, and the job's record after it."""

    def command(args: argparse.Namespace) -> int:
        record = getattr(connect_service(args), verb)(args.job)
        if args.json:
            print(strict_json.dumps(record.as_dict(), indent=1))
        elif record.state == "running" and running_note:
            print(f"{record.id}: {record.state} ({running_note})")
        else:
            print(f"{record.id}: {record.state} ({record.reason})")
        return 0

    return command


cmd_cancel = _job_command("cancel", "cancelling at its next step")
cmd_pause = _job_command("pause", "pausing at its next step")
cmd_resume = _job_command("resume", "")


def cmd_extend(args: argparse.Namespace) -> int:
    """`aspen extend JOB --max-steps N` / `--epochs N` (or both): the job queued again, to train on from its
    checkpoint to the new budget. Where no service runs and the job is an ended `aspen run`'s, how that run continues
    it instead."""
    from orchestrator.errors import ClusterRefused, ServiceError
    from orchestrator.recent_runs import RecentRuns

    if args.max_steps is None and args.epochs is None:
        print("aspen: extend: give --max-steps N, --epochs N or both (the job's budget raised)", file=sys.stderr)
        return 2
    budget = " and ".join(f"its {name} to {value:g}" for name, value in (("max_steps", args.max_steps),
                                                                         ("epochs", args.epochs)) if value is not None)
    try:
        client = connect_service(args)
    except ServiceError as error:
        run = None if args.url or isinstance(error, ClusterRefused) else RecentRuns().find(args.job)
        if run is None:
            raise
        raise ServiceError(f"{error}; job '{args.job}' is of the `aspen run` of {run.jobs_file}, which has ended: "
                           f"set {budget} there and run `aspen run {run.jobs_file}` again (it continues from its "
                           "checkpoint), or extend it on a service that runs it") from None
    record = client.raise_budget(args.job, args.max_steps, args.epochs)
    if args.json:
        print(strict_json.dumps(record.as_dict(), indent=1))
    else:
        print(f"{record.id}: {record.state} ({record.reason})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from orchestrator.client import Client

    Client.connect(args.address).shutdown()
    print("aspen service stopped (unfinished jobs resume from their checkpoints when it starts again)")
    return 0
