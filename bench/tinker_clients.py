#!/usr/bin/env python
"""N concurrent users' Tinker training loops on one base: aspen's fused serving against the same server serving
one call at a time. Each client is the real `tinker` SDK running a supervised loop on its own data
(forward_backward with cross_entropy, then optim_step, both sent before waiting, as tinker-cookbook's loops do).

Two servers, each in its own process (bench/tinker_peers.py serve, as docs/tinker.md serves the API):
- fused: calls of different models that are ready together, or arrive within `--window-s`, share one pass
  through the base (InteractiveCalls' default);
- time-sliced: `window_s=0, max_models_per_pass=1`: each model's call goes through the base alone, the models
  taking turns, as the open backends that time-slice one base among users run them.
For each N (`--clients 1,2,4`), the N clients run on one server, then on the other (the order alternates with
N and with the round, `--rounds`, so that the machine's drift does not favour one side; rounds are pooled).
Each client runs `--warmup` steps, waits for the others, then `--steps` timed steps. Reported: trained tokens/s
of all clients together (tokens through the base: each datum's model input, counted from the timed steps,
over the time from the common start to the last client's end), each client's step latency (p50, p95: from
sending forward_backward to optim_step's result), and fused / time-sliced.

The API's overhead: a lone aspen job (bench/tinker_peers.py lone: `train_locally`, what `aspen run
--in-process` runs) on the same base, rank, batch and data as client 0, in its own process, timed over its
steps after the same warm-up; the 1-client fused figure over it is the goal's ratio (>= 0.9).

What bounds the gain, two ways. (1) Arithmetic: a step's matmuls (4 FLOPs per base weight per token: the
forward and the backward to the activations, the base frozen) at the machine's measured matmul rate bound any
server's tokens/s, so fused / time-sliced <= ceiling / time-sliced. (2) A simple model fitted from the run
(`fixed_cost`): a call costs a + r t, a pass of k calls a + k r t; fusing removes only the per-pass a, so
fused / time-sliced <= (a + r t) / (r t) at any N. On a CPU a 135M base's call is mostly work that grows with
its tokens (arithmetic, and memory-bound work such as the 49k-word softmax), so the bound is small
(docs/benchmarks.md); on a GPU a small base's call is mostly per-pass cost (kernel launches, synchronisations,
the Python between), which is what fusing removes.
At N=1 both servers do the same work: how far their ratio is from 1 is the run's noise.

    python bench/tinker_clients.py [--base smollm2-135m|tiny] [--data /work/shared/data/gsm8k_train.jsonl]
        [--clients 1,2,4] [--steps 10] [--warmup 1] [--batch 1] [--rank 16] [--rounds 1] [--no-lone] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import tinker_peers

MODES = ("fused", "time-sliced")
START_TIMEOUT_S = 300


def log(message: str) -> None:
    print(message, flush=True)


def percentile(values: list[float], share: float) -> float:
    return float(np.percentile(values, share * 100)) if values else float("nan")


class Server:
    """One mode's server process: started, its URL read from its first line, stopped at the end."""

    def __init__(self, mode: str, base: str, name: str, folder: Path, window_s: float, threads: int):
        self.mode, self.passes = mode, folder / f"passes-{mode}.jsonl"
        command = [sys.executable, str(BENCH / "tinker_peers.py"), "serve", "--base", base, "--name", name,
                   "--passes", str(self.passes), "--window-s", str(window_s), "--threads", str(threads)]
        self.process = subprocess.Popen(command + (["--sliced"] if mode == "time-sliced" else []),
                                        stdout=subprocess.PIPE, text=True, env=child_env())
        self.info: dict = {}

    def ready(self) -> dict:
        if not self.info:
            line = self.process.stdout.readline()
            if not line.startswith("READY "):
                raise SystemExit(f"the {self.mode} server did not start (exit {self.process.wait()}): {line!r}")
            self.info = json.loads(line.removeprefix("READY "))
        return self.info

    def pass_count(self) -> int:
        return len(self.passes.read_text().splitlines()) if self.passes.exists() else 0

    def passes_since(self, start: int) -> list[dict]:
        return [json.loads(line) for line in self.passes.read_text().splitlines()[start:]]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def child_env() -> dict:
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": str(REPO)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # processes share 2 cores: threads at a barrier sleep
    return env


def datums(sequences: list[tuple[list[int], list[int]]]) -> tuple[list, int, float]:
    """Tinker datums of (input ids, labels): the model reads ids[:-1] and predicts ids[1:], weighted where the
    label is a target; the tokens that go through the base, and the target tokens."""
    from tinker import types

    out = []
    for ids, labels in sequences:
        weights = np.array([0.0 if label == -100 else 1.0 for label in labels[1:]], dtype=np.float32)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                               "weights": weights}))
    targets = sum(float(datum.loss_fn_inputs["weights"].to_numpy().sum()) for datum in out)
    return out, sum(len(ids) - 1 for ids, _ in sequences), targets


def client_loop(url: str, user: str, base_name: str, rank: int, batches: list, warmup: int,
                barrier: threading.Barrier, result: dict) -> None:
    """One user's SFT loop through the SDK; its timed steps into `result`."""
    import tinker
    from tinker import types

    try:
        with tinker.ServiceClient(base_url=url, api_key=f"tml-{user}") as service:
            training = service.create_lora_training_client(base_model=base_name, rank=rank).result()
            adam = types.AdamParams(learning_rate=1e-4)
            result.update(latencies=[], tokens=0, losses=[], sent_tokens=0)
            for index, (batch, tokens, targets) in enumerate(batches):
                if index == warmup:
                    barrier.wait()
                    result["start"] = time.perf_counter()
                sent = time.perf_counter()
                backward = training.forward_backward(batch, "cross_entropy")
                stepped = training.optim_step(adam)
                output = backward.result()
                stepped.result()
                done = time.perf_counter()
                result["sent_tokens"] += tokens
                if index >= warmup:
                    result["latencies"].append(done - sent)
                    result["tokens"] += tokens
                    result["losses"].append(output.metrics["loss:sum"] / targets)   # per target token
            result["end"] = time.perf_counter()
    except BaseException as error:
        result["error"] = error
        barrier.abort()
        raise


def run_clients(server: Server, base_name: str, rank: int, warmup: int, work: list[list]) -> dict:
    """N clients at once on `server`; their figures, and the passes the server ran for them."""
    first_pass = server.pass_count()
    barrier = threading.Barrier(len(work))
    results = [{} for _ in work]
    threads = [threading.Thread(target=client_loop, args=(server.ready()["url"], f"user{i}", base_name, rank,
                                                          batches, warmup, barrier, results[i]), daemon=True)
               for i, batches in enumerate(work)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r["error"] for r in results if "error" in r and not isinstance(r["error"], threading.BrokenBarrierError)]
    if errors:
        raise RuntimeError(f"a client failed on the {server.mode} server") from errors[0]
    passes = [p for p in server.passes_since(first_pass) if p["backward"]]
    return {"tokens": sum(r["tokens"] for r in results),
            "seconds": max(r["end"] for r in results) - min(r["start"] for r in results),
            "clients": [{key: r[key] for key in ("latencies", "tokens", "losses")} for r in results],
            "models": [len(p["models"]) for p in passes],
            "sent_tokens": sum(r["sent_tokens"] for r in results),   # warm-up included
            "server_tokens": sum(p["tokens"] for p in passes)}       # what the server's passes took


def summarize(runs: list[dict]) -> dict:
    """One mode's rounds at one N as one: tokens and seconds summed, each client's latencies pooled."""
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    clients = []
    for index in range(len(runs[0]["clients"])):
        mine = [r["clients"][index] for r in runs]
        latencies = [t for c in mine for t in c["latencies"]]
        clients.append({"p50_s": percentile(latencies, 0.5), "p95_s": percentile(latencies, 0.95),
                        "steps": len(latencies), "tokens": sum(c["tokens"] for c in mine),
                        "first_loss": mine[0]["losses"][0], "last_loss": mine[0]["losses"][-1],
                        "latencies_s": latencies})
    models = [m for r in runs for m in r["models"]]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "clients": clients,
            "passes": len(models), "models_per_pass": statistics.mean(models),
            "rounds_tokens_per_s": [r["tokens"] / r["seconds"] for r in runs],
            "sent_tokens": sum(r["sent_tokens"] for r in runs), "server_tokens": sum(r["server_tokens"] for r in runs)}


class LoneJob:
    """The lone aspen job's process: started (it loads the base), then run when `run` is called."""

    def __init__(self, base: str, args: argparse.Namespace, folder: Path):
        self.args, self.rows, self.out = args, folder / "lone-rows.jsonl", folder / "lone.json"
        self.format = folder / "lone-format.json"
        command = [sys.executable, str(BENCH / "tinker_peers.py"), "lone", "--base", base, "--rows", str(self.rows),
                   "--format-file", str(self.format), "--out", str(self.out), "--batch", str(args.batch),
                   "--steps", str(args.warmup + args.steps), "--rank", str(args.rank),
                   "--max-seq-len", str(tinker_peers.MAX_SEQ_LEN), "--threads", str(args.threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=child_env())

    def ready(self) -> None:
        line = self.process.stdout.readline()
        if line.strip() != "READY":
            raise SystemExit(f"the lone job did not start (exit {self.process.wait()}): {line!r}")

    def run(self, rows: list[dict], fmt: dict) -> dict:
        self.rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
        self.format.write_text(json.dumps(fmt))
        self.process.stdin.write("go\n")
        self.process.stdin.close()
        if self.process.wait() != 0:
            raise SystemExit(f"the lone aspen job failed (exit {self.process.returncode})")
        found = json.loads(self.out.read_text())
        steps, warmup = found["steps"], self.args.warmup
        timed = steps[warmup:]
        start = steps[warmup - 1]["end"] if warmup else steps[0]["end"] - steps[0]["seconds"]
        seconds = timed[-1]["end"] - start
        tokens = sum(step["tokens"] for step in timed)
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "steps": len(timed),
                "sequences_per_step": statistics.mean(step["sequences"] for step in timed),
                "first_loss": found["first_loss"], "final_loss": found["final_loss"]}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def matmul_flops_per_s(threads: int, width: int = 576, bursts: int = 10, burst_s: float = 0.2) -> float:
    """The float32 matmul rate of this process's cores on a base-sized product (512 tokens x width x 4 width):
    the best of a few short bursts, so that another process's moment on the cores does not lower it (the
    ceiling it sets is an upper bound)."""
    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(512, width), torch.randn(width, 4 * width)
    a @ b
    best = 0.0
    for _ in range(bursts):
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < burst_s:
            a @ b
            count += 1
        best = max(best, count * 2 * 512 * width * 4 * width / (time.perf_counter() - started))
    return best


def base_of(args: argparse.Namespace, folder: Path, tokenizer) -> tuple[str, str]:
    """The base as the servers and the lone job load it, and the name clients give it."""
    if args.base == "tiny":
        return str(tinker_peers.tiny_base_folder(folder / "tiny-base", tokenizer)), "tiny-llama"
    return args.base, args.base


def client_work(args: argparse.Namespace, tokenizer) -> tuple[list[list], list[dict], dict]:
    """Each client's batches (its own rows), client 0's rows and their format (the lone job's data)."""
    per_client = (args.warmup + args.steps) * args.batch
    rows, fmt = tinker_peers.make_rows(args.data, per_client * max(args.clients), tokenizer)
    work = []
    for client in range(max(args.clients)):
        sequences = tinker_peers.tokenized(rows[client * per_client:(client + 1) * per_client], fmt, tokenizer,
                                           tinker_peers.MAX_SEQ_LEN)
        work.append([datums(sequences[i:i + args.batch]) for i in range(0, len(sequences), args.batch)])
    return work, rows[:per_client], fmt


def fixed_cost(results: dict) -> dict | None:
    """The simple model behind the ratio: a call costs `a + r t` (t its tokens; r everything that grows with
    tokens or models: arithmetic, memory-bound work, each model's optimizer step), a pass of k calls `a + k r t`:
    fusing removes only `a`, so fused / time-sliced <= (a + r t) / (r t) however many clients. Fitted from the
    largest N: time-sliced, a call takes c = N t / S (the server always busy); fused, a pass of k models (its
    measured mean) takes k t / F; a = k t (1/S - 1/F) / (k - 1). None where no pass was fused."""
    n = max(results)
    fused, sliced = results[n]["fused"], results[n]["time-sliced"]
    k = fused["models_per_pass"]
    if n < 2 or k <= 1:
        return None
    t = sliced["tokens"] / sum(c["steps"] for c in sliced["clients"])   # mean tokens of a call
    call = t / sliced["tokens_per_s"]   # the server runs one call at a time
    fixed = k * t * (1 / sliced["tokens_per_s"] - 1 / fused["tokens_per_s"]) / (k - 1)
    return {"n": n, "tokens_per_call": t, "call_s": call, "fixed_s": fixed,
            "bound": call / (call - fixed) if call > fixed else float("inf")}


def report(results: dict, lone: dict | None, ceiling: float) -> None:
    log(f"\n{'N':>3} {'mode':<12} {'tokens/s':>9} {'passes':>7} {'models/pass':>12}  client step latency p50/p95 (s)")
    for n, modes in results.items():
        for mode in MODES:
            r = modes[mode]
            latencies = "  ".join(f"{c['p50_s']:.2f}/{c['p95_s']:.2f}" for c in r["clients"])
            log(f"{n:>3} {mode:<12} {r['tokens_per_s']:>9.1f} {r['passes']:>7} {r['models_per_pass']:>12.2f}  "
                f"{latencies}")
    log("")
    for n, modes in results.items():
        same = " (the same work on both: its distance from 1 is this run's noise)" if n == 1 else ""
        each = ", ".join(f"{r:.2f}" for r in modes["rounds_ratio"])
        rounds = f" (rounds: {each})" if len(modes["rounds_ratio"]) > 1 else ""
        log(f"N={n}: fused / time-sliced = {modes['ratio']:.2f}x{rounds} (arithmetic ceiling over time-sliced: "
            f"{ceiling / modes['time-sliced']['tokens_per_s']:.2f}x){same}")
    if lone is not None and 1 in results:
        log(f"lone aspen job: {lone['tokens_per_s']:.1f} tokens/s ({lone['steps']} steps, "
            f"{lone['sequences_per_step']:.1f} sequences each); 1 client fused / lone job = "
            f"{results[1]['fused']['tokens_per_s'] / lone['tokens_per_s']:.2f} (goal >= 0.9)")
    log(f"arithmetic ceiling (4 FLOPs per base weight per token at the measured matmul rate): {ceiling:.0f} tokens/s")
    model = fixed_cost(results)
    if model is not None:
        log(f"simple model (N={model['n']}): a call of {model['tokens_per_call']:.0f} tokens takes "
            f"{model['call_s']:.2f} s, of which {model['fixed_s']:.2f} s is per pass (what fusing removes); the rest "
            f"grows with tokens and models, so fused / time-sliced <= {model['bound']:.2f}x at any N")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=tinker_peers.SMOLLM2, help="smollm2-135m (default) or tiny")
    parser.add_argument("--data", type=Path, help="GSM8K rows (e.g. /work/shared/data/gsm8k_train.jsonl); "
                                                  "default: random tokens of 64-320 tokens")
    parser.add_argument("--clients", default="1,2,4", help="client counts, comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per client (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per client first (default 1)")
    parser.add_argument("--batch", type=int, default=1, help="datums per forward_backward (default 1: the default "
                                                             "run stays near 5 minutes on 2 CPU cores)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=0.005, help="the fused server's window (default 0.005)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the servers and the lone job "
                                                              "(default: torch's, the cores)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the N sweep, the modes' order alternating "
                                                              "(default 1); figures pool the rounds")
    parser.add_argument("--no-lone", action="store_true", help="skip the lone aspen job")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.clients = sorted({int(n) for n in args.clients.split(",")})
    os.environ.update(TINKER_TELEMETRY="0")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as tmp:
        folder = Path(tmp)
        tokenizer = tinker_peers.smollm2_tokenizer()
        base, name = base_of(args, folder, tokenizer)
        # the servers load while the data is made; once ready they idle (no CPU) through the lone job
        servers = {mode: Server(mode, base, name, folder, args.window_s, args.threads) for mode in MODES}
        job = None if args.no_lone else LoneJob(base, args, folder)
        try:
            work, lone_rows, fmt = client_work(args, tokenizer)
            info = {mode: server.ready() for mode, server in servers.items()}
            if job is not None:
                job.ready()
            log(f"data, servers and the lone job's base ready ({time.perf_counter() - started:.0f} s)")
            ceiling_flops = matmul_flops_per_s(args.threads)
            lone = None if job is None else job.run(lone_rows, fmt)
            log(f"lone aspen job done ({time.perf_counter() - started:.0f} s)")
            for server in servers.values():   # untimed: a fresh process's first passes are slow (measured
                run_clients(server, name, args.rank, 1, [work[0][:3]])   # 0.76-0.9x at N=1 on whichever ran first)
            runs: dict[int, dict[str, list]] = {n: {mode: [] for mode in MODES} for n in args.clients}
            for round_ in range(args.rounds):   # the modes' order alternates with N and with the round
                for index, n in enumerate(args.clients):
                    for mode in (MODES if (index + round_) % 2 == 0 else MODES[::-1]):
                        log(f"round {round_ + 1}: N={n} {mode}...")
                        runs[n][mode].append(run_clients(servers[mode], name, args.rank, args.warmup, work[:n]))
            results = {n: {mode: summarize(modes[mode]) for mode in MODES} for n, modes in runs.items()}
            for modes in results.values():
                modes["ratio"] = modes["fused"]["tokens_per_s"] / modes["time-sliced"]["tokens_per_s"]
                modes["rounds_ratio"] = [f / t for f, t in zip(modes["fused"]["rounds_tokens_per_s"],
                                                               modes["time-sliced"]["rounds_tokens_per_s"],
                                                               strict=True)]
            ceiling_flops = max(ceiling_flops, matmul_flops_per_s(args.threads))   # again, after the clients
        finally:
            for peer in [*servers.values(), *([job] if job else [])]:
                peer.stop()
    ceiling = ceiling_flops / (4 * info["fused"]["linear_parameters"])
    report(results, lone, ceiling)
    if args.json:
        args.json.write_text(json.dumps({
            "base": args.base, "data": str(args.data) if args.data else "random", "batch": args.batch,
            "rank": args.rank, "warmup": args.warmup, "steps": args.steps, "window_s": args.window_s,
            "rounds": args.rounds,
            "server": info["fused"], "matmul_flops_per_s": ceiling_flops, "arithmetic_ceiling_tokens_per_s": ceiling,
            "fixed_cost_model": fixed_cost(results),
            "results": {str(n): r for n, r in results.items()}, "lone": lone,
            "one_client_over_lone": (results[1]["fused"]["tokens_per_s"] / lone["tokens_per_s"]
                                     if lone and 1 in results else None),
            "machine": {"cpus": os.cpu_count(), "torch_threads": info["fused"]["threads"]},
            "wall_s": time.perf_counter() - started}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
