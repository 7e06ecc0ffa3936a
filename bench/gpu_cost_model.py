#!/usr/bin/env python
"""A model of the fused GPU step that runs on a CPU (issue 47, item 6): the checkout's real step code runs on
a virtual CUDA device (meta tensors that call themselves cuda:0), every kernel-level operation is recorded
with its FLOPs, bytes, launches and host synchronisations, each is timed from the card's ceilings, and a
timeline of the host issuing them and the GPU running them predicts the step. The card's parameters are read
off the last H200 lease's profile (2026-12-04, main f1d6eda), each lease machine's host costs off its own
(bench/gpu_cost/calibration.json); docs/cost_model.md says how it works, its parameters and how well it does.

    bench/gpu_cost_model.py --shape llama-3.1-8b --jobs 4 --card h200 --json F
    bench/gpu_cost_model.py --set actors.engine.lora_grouped:GROUPING=segments     # rank a change before making it
    bench/gpu_cost_model.py --fusion 1,2,4,8,16,32                          # fusion efficiency, equal tokens
    bench/gpu_cost_model.py --base                                          # the frozen base alone
    bench/gpu_cost_model.py --peers                                         # the PEFT baselines, aspen's ratios
    bench/gpu_cost_model.py --fusion 1,32 --read-later --no-calibration     # what-if: values read a step later
    bench/gpu_cost_model.py --shape smollm2-135m --graphed --no-calibration # what-if: steps as CUDA graphs
    bench/gpu_cost_model.py --checkout /other/checkout --no-calibration
    bench/gpu_cost_model.py --host h200-2026-11-28                          # another lease machine's host costs
    bench/gpu_cost_model.py --host-probe probe.json                         # a probed machine's (bench/host_probe.py)

Writes predicted_step_s (the median of the timed steps), predicted_tokens_per_s (over them) and
predicted_lora_mfu (bench/lora_mfu.py's count, against the 989.4 TFLOP/s datasheet peak) for the checkout,
its steps run as bench/lora_mfu.py's aspen side runs them (2 warm-up steps, then --steps timed, in order,
back to back),
and calibration_error: the prediction of the profiled step by the code of 70c0645 against the measured
0.682 s, signed ((predicted - measured) / measured), timed with the host costs of the machine that measured it
(calibration.json "measured".host; the host is the machine's, not the card's). Each checkout runs in a process of
its own."""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULT = "RESULT "
FUSION_ADAPTERS = (1, 2, 4, 8, 16, 32)


def _worker(spec: dict) -> int:
    sys.path.insert(0, str(Path(spec["checkout"]).resolve()))
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    from gpu_cost.predict import run_worker

    print(RESULT + json.dumps(run_worker(spec)), flush=True)
    return 0


def run_checkout(spec: dict, label: str) -> dict:
    """One checkout's predictions, in a fresh process (two checkouts never share one)."""
    started = time.perf_counter()
    print(f"[{label}] recording {spec['mode']} steps of {spec['checkout']} on the virtual device...", file=sys.stderr,
          flush=True)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                         capture_output=True, text=True, check=False, cwd=str(BENCH))
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-6000:])
        raise SystemExit(f"[{label}] the worker for {spec['checkout']} failed (exit {out.returncode})")
    line = next((line for line in reversed(out.stdout.splitlines()) if line.startswith(RESULT)), None)
    if line is None:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"[{label}] the worker printed no result")
    print(f"[{label}] done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return json.loads(line[len(RESULT):])


def calibration_checkout(commit: str, where: Path | None) -> Path:
    """A checkout of `commit` (from this repository's history, by git archive), made once."""
    target = where or Path(tempfile.gettempdir()) / f"aspen-gpu-cost-{commit}"
    if (target / "actors" / "engine" / "trainer.py").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {commit} failed: {archive.stderr.decode()[-500:]} (give --calibration-checkout "
                         "PATH, a checkout of that commit, or --no-calibration)")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def _parser() -> argparse.ArgumentParser:
    from gpu_cost.calibration import CALIBRATION_COMMIT, PATH
    from gpu_cost.peers import PEERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--jobs", type=int, default=4, help="fused jobs, 1..32")
    parser.add_argument("--card", default="h200", choices=("h200", "h100"))
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps of the checkout's run, after 2 warm-up ones, as bench/lora_mfu.py times them")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--checkout", type=Path, default=REPO, help="the checkout to model (default: this one)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="module:ATTR=value",
                        help="set a module attribute before the steps (repeatable), e.g. "
                             "actors.engine.lora_grouped:GROUPING=segments")
    parser.add_argument("--kernels", choices=("auto", "liger", "none"),
                        help="the base's kernels setting where the checkout has one (from_module's kernels)")
    parser.add_argument("--fusion", nargs="?", const=",".join(map(str, FUSION_ADAPTERS)),
                        help="adapters to predict fusion efficiency for (alone: 1,2,4,8,16,32)")
    parser.add_argument("--base", action="store_true", help="also the frozen base alone")
    parser.add_argument("--peers", nargs="?", const=",".join(PEERS),
                        help="also bench/lora_mfu.py's single-job PEFT sides, each in its own process, over the same "
                             f"sequences and --steps (alone: {','.join(PEERS)}); aspen's ratio to each")
    parser.add_argument("--read-later", action="store_true",
                        help="a what-if: aspen's steps (and --fusion's) timed as if each read its values back a step "
                             "later (their host synchronisations dropped); the PEFT sides and the calibration as they "
                             "are")
    parser.add_argument("--graphed", action="store_true",
                        help="a what-if: aspen's steps (and --fusion's) timed as if each one's work up to its "
                             "read-back were replayed from a captured CUDA graph (its host cost dropped), and what "
                             "stands in the way of capturing them today")
    parser.add_argument("--fixed-shapes", action="store_true",
                        help="aspen's steps (and --fusion's) as compile: graphs makes them: each job's tokens in a "
                             "fixed segment (actors/engine/fixed_shapes.py), run eagerly here (no capture on the "
                             "virtual device); with --graphed, timed as their replays, the blockers counted on them")
    parser.add_argument("--calibration-checkout", type=Path, help=f"a checkout of {CALIBRATION_COMMIT}")
    parser.add_argument("--no-calibration", action="store_true", help=f"skip the run of {CALIBRATION_COMMIT}")
    parser.add_argument("--calibration-file", type=Path, default=PATH)
    parser.add_argument("--host", metavar="MACHINE",
                        help="whose host costs time the steps (a lease machine of the calibration's, e.g. "
                             "h200-2026-11-28; default: the last profiled one's)")
    parser.add_argument("--host-probe", type=Path, metavar="FILE",
                        help="price the host by a machine's host probe (bench/host_probe.py --json FILE, run on that "
                             "machine: the lease's host part) instead of a calibrated machine's costs")
    return parser


def _calibration(args: argparse.Namespace, parser: argparse.ArgumentParser, calibration: dict) -> dict:
    """The calibration the steps are priced by: the file's, or with --host-probe its machine's host costs instead
    (written to a temporary file, which the workers read; args.host and args.calibration_file then name it)."""
    from gpu_cost.calibration import with_probe

    if not args.host_probe:
        return calibration
    if args.host:
        parser.error("--host and --host-probe: one host, either a calibrated machine or a probed one")
    try:
        calibration, args.host = with_probe(calibration, json.loads(args.host_probe.read_text()))
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--host-probe {args.host_probe}: not a host probe's JSON ({type(error).__name__}: "
                     f"{error}); bench/host_probe.py --json FILE writes one")
    folder = tempfile.mkdtemp(prefix="gpu-cost-probe-")   # the workers read the calibration from a file
    atexit.register(shutil.rmtree, folder, True)
    probed = Path(folder) / "calibration.json"
    probed.write_text(json.dumps(calibration))
    args.calibration_file = probed
    return calibration


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return _worker(json.loads(sys.argv[2]))
    sys.path.insert(0, str(BENCH))
    from gpu_cost import report
    from gpu_cost.calibration import CALIBRATION_COMMIT, default_machine, host_for, load
    from gpu_cost.peers import PEERS

    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.jobs <= 32:
        parser.error("--jobs must be 1..32")
    calibration = _calibration(args, parser, load(args.calibration_file))
    try:
        host_for(calibration, args.host)
    except ValueError as error:
        parser.error(f"--host: {error}")
    spec = {"checkout": str(args.checkout.resolve()), "shape": args.shape, "jobs": args.jobs, "card": args.card,
            "mode": "jobs", "steps": args.steps, "settings": args.settings, "kernels": args.kernels,
            "calibration": str(args.calibration_file.resolve()), "read_later": args.read_later, "graphed": args.graphed,
            "host": args.host, "fixed_shapes": args.fixed_shapes}
    results: dict = {"shape": args.shape, "jobs": args.jobs, "card": args.card, "steps": args.steps,
                     "host": args.host or default_machine(calibration)}
    current = run_checkout(spec, "checkout")
    results["current"] = current
    for key in ("predicted_step_s", "predicted_tokens_per_s", "predicted_lora_mfu"):
        results[key] = current[key]
    if not args.no_calibration:
        measured = calibration["measured"]
        checkout = calibration_checkout(CALIBRATION_COMMIT, args.calibration_checkout)
        old = run_checkout({**spec, "checkout": str(checkout), "shape": measured["shape"], "jobs": measured["jobs"],
                            "card": measured["card"], "settings": [], "kernels": None, "profile_step": True,
                            "read_later": False, "graphed": False, "host": measured.get("host")},
                           CALIBRATION_COMMIT)
        results["calibration"] = old
        results["calibration_error"] = (old["predicted_step_s"] - measured["step_s"]) / measured["step_s"]
    if args.fusion:
        adapters = [int(n) for n in args.fusion.split(",")]
        results["fusion"] = run_checkout({**spec, "mode": "fusion", "adapters": adapters}, "fusion")
    if args.base:
        results["base"] = run_checkout({**spec, "mode": "base"}, "base")
    if args.peers:
        unknown = sorted(set(args.peers.split(",")) - set(PEERS))
        if unknown:
            parser.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
        results["peers"] = {peer: run_checkout({**spec, "mode": "peer", "peer": peer}, peer)
                            for peer in args.peers.split(",")}
        results["ratios"] = report.ratios(results)
    print(report.render(results, calibration), flush=True)
    results["parameters"] = report.parameters(args.card, calibration)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
