"""The `aspen` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.spec import SpecError, load_run_spec


def _cmd_run(args: argparse.Namespace) -> int:
    from actors.engine.local_run import train_locally

    spec = load_run_spec(args.file)
    if args.output_dir:
        spec = spec.model_copy(update={"output_dir": args.output_dir})
    summaries = train_locally(spec, progress=not args.quiet)
    print(f"\n{'job':<24}{'steps':>7}{'tokens':>10}{'first loss':>12}{'final loss':>12}{'eval loss':>11}")
    for s in summaries:
        fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        print(f"{s.name:<24}{s.steps:>7}{s.tokens:>10}{fmt(s.first_loss):>12}{fmt(s.final_loss):>12}"
              f"{fmt(s.eval_loss):>11}")
    print(f"\nadapters and metrics in {spec.output_dir}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo

    return run_demo(output_dir=args.output_dir, steps=args.steps, quiet=args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aspen", description="Fine-tune many LoRA adapters at once on one "
                                     "shared, frozen base model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train every job of a jobs YAML file to completion")
    run.add_argument("file", help="jobs YAML file")
    run.add_argument("--output-dir", help="override output_dir of the file")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(handler=_cmd_run)

    demo = commands.add_parser("demo", help="train 4 small generated tasks on smollm2-135m and show accuracy")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per job")
    demo.add_argument("-q", "--quiet", action="store_true")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except SpecError as error:
        print(f"aspen: invalid jobs file:\n{error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as error:
        print(f"aspen: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
