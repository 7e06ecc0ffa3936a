"""How much a little outside CPU work slows the engine's fused steps on a small CPU machine: the in-process
engine (bench/overhead.py's four jobs) alone and beside burner processes at nice 10, each busy a small share
of the time in short bursts (as a service's idle actors and Ray's daemons are), A-B-B-A, side by side.

    python bench/interference.py [--steps 12] [--burners 4] [--share 0.02]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead import (
    TASKS,
    TRAIN_ROWS,
    TRAIN_SEED,
    build_spec,
    load_base_model,
    log,
    make_rows,
    run_in_process,
    write_jsonl,
)

BURNER = """
import os, sys, time
share, period = float(sys.argv[1]), 0.05
os.nice(10)
while True:
    end = time.perf_counter() + share * period
    while time.perf_counter() < end:
        pass
    time.sleep(period * (1 - share))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--burners", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.02, help="share of one core each burner keeps busy")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="aspen-interference-"))
    data = {task.name: write_jsonl(work / "data" / f"{task.name}.jsonl", make_rows(task, TRAIN_ROWS, TRAIN_SEED))
            for task in TASKS}
    spec = build_spec(work / "run", data, args.steps)
    base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device)
    seconds: dict[str, float] = {"alone": 0.0, "beside burners": 0.0}
    for index, side in enumerate(["alone", "beside burners", "beside burners", "alone"]):
        burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(args.share)])
                   for _ in range(args.burners if side != "alone" else 0)]
        try:
            log(f"{side}:")
            seconds[side] += run_in_process(spec.model_copy(update={"output_dir": work / str(index)}), base)[
                "compute_seconds"]
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
    outside = args.burners * args.share
    log(f"\noutside work: {args.burners} processes x {args.share:.0%} of a core = {outside:.0%} of one core "
        f"({outside / 2:.0%} of a 2-core machine)")
    log(f"engine steps beside it / alone (time inside steps, 2 runs each): "
        f"{seconds['alone'] / seconds['beside burners']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
