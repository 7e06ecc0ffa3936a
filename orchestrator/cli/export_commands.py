"""`aspen export` (a PEFT folder, or with --merge a merged model; from a folder, a run, a service or its HTTP API)
with the lines that serve and load it, and `aspen demo`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import strict_json

if TYPE_CHECKING:
    pass


def _export_over_http(args: argparse.Namespace) -> Path:
    """`aspen export JOB --url`: the adapter fetched through the HTTP API; with --merge merged here."""
    import tempfile

    from actors.checkpoint.adapter_export import export_merged
    from orchestrator.http.api_client import HttpClient

    with HttpClient(args.url) as client:
        if not args.merge:
            return client.export(args.job, args.out, checkpoint=args.checkpoint, force=args.force)
        record = client.status(args.job)
        out = Path(args.out) if args.out else Path.cwd() / f"{record.name}-merged"
        with tempfile.TemporaryDirectory(prefix="aspen-export-") as scratch:
            adapter = client.export(record.id, Path(scratch) / "adapter", checkpoint=args.checkpoint)
            return export_merged(adapter, out, base=args.base, dtype=args.dtype, force=args.force)


def cmd_export(args: argparse.Namespace) -> int:
    """`aspen export JOB`: a PEFT folder for vLLM's --lora-modules, or with --merge a merged transformers folder."""
    from orchestrator.export import export_job

    def service(job: str):
        from orchestrator.client import Client, ServiceError
        from orchestrator.recent_runs import EndedRun, RecentRuns, where_else

        try:
            return Client.connect(args.address).status(job)
        except KeyError as error:   # a service runs, without this job
            raise where_else(error, job) from None
        except ServiceError as error:
            run = RecentRuns().find(job)   # a run that has ended: its own job table knows where the job is
            if run is not None:
                print(f"aspen: no aspen service is running; '{job}' is a job of the run in {run.output_dir}",
                      file=sys.stderr)
                return EndedRun(run.state_dir).status(job)
            raise ServiceError(f"'{job}' is not a job folder, and asking the service for it failed: {error}; give "
                               "the job's folder, or --from with the run's output folder") from None

    from orchestrator.progress import quiet_loading_bars

    quiet_loading_bars()   # transformers' loading and writing bars: not for a log
    if args.url and args.from_dir is None:   # over the HTTP API: the service sends it (its owner's or an admin's)
        out = _export_over_http(args)
    else:
        out = export_job(args.job, args.out, merge=args.merge, force=args.force, checkpoint=args.checkpoint,
                         run_dir=args.from_dir, base=args.base, dtype=args.dtype, service=service)
    if args.json:
        print(strict_json.dumps({"job": args.job, "folder": str(out), "merged": args.merge}, indent=1))
    elif args.merge:
        print(f"merged model (transformers, safetensors) in {out}; serve it with:\n  vllm serve {out.resolve()}\n"
              f"or load it with transformers: AutoModelForCausalLM.from_pretrained({str(out.resolve())!r})")
    else:
        print(f"PEFT adapter in {out}")
        print(_serving_text(out))
    return 0


def _serving_text(adapter: Path) -> str:
    """How to serve and load an exported adapter, as lines that run on this machine (checkpoint/serving_lines)."""
    from actors.checkpoint.serving_lines import adapter_serving_lines

    try:
        lines = adapter_serving_lines(adapter)
    except (OSError, ValueError, KeyError) as error:   # the base is not on this machine (an export over HTTP)
        return (f"its base is not on this machine ({error}); load it with PEFT onto the base its "
                f"adapter_config.json names (base_model_name_or_path)")
    parts = []
    if lines.vllm:
        parts.append(f"Serve it on this machine:\n  {lines.vllm}")
    parts.append("Load it with PEFT:\n" + "\n".join(f"  {line}" if line else "" for line in lines.peft.splitlines()))
    parts.append(lines.elsewhere)
    return "\n".join(parts)


def cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo

    return run_demo(output_dir=args.output_dir, steps=args.steps, quiet=args.quiet)
