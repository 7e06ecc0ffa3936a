#!/usr/bin/env python
"""A user's custom loss through the Tinker API, run on the server against the SDK's own client-side way: one user's
RL-style loop (a PPO-like clipped objective over the sampled tokens, with a penalty and two metrics, made by
`create_custom_loss`), `forward_backward_custom` then `optim_step` a step.

- server: the handle with its `loss_id` (aspen's client config turns `custom_loss_server_side` on): one
  forward-backward a step, the loss run on every datum inside the pass (actors/engine/custom_loss.py);
- client: the same handle without it, the SDK's way for a server that does not run losses: a forward, the logprobs
  back to the client, the loss and its gradient there, then a forward-backward of the gradient as weights.

Both sides are the same user's two models (the same seed and data) on one server process (bench/tinker_peers.py
serve, the API as docs/tinker.md serves it), in turns A-B-B-A (`--rounds`) so that the machine's drift favours
neither. Reported: each side's median step (forward_backward_custom + optim_step, after `--warmup` steps), the
ratio client / server, the server's passes a step, and whether both sides' losses agreed bit for bit at every
step (they compute the same float32 operations: docs/tinker.md).

    python bench/tinker_custom_loss.py [--base smollm2-135m|tiny] [--steps 6] [--warmup 1] [--batch 4]
        [--rank 16] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import tinker_clients
import tinker_peers

SIDES = ("server", "client")


def clipped_pg(logprobs, logprobs_old, advantages, mask):
    ratio = torch.exp(logprobs - logprobs_old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    penalty = 0.01 * ((logprobs - logprobs_old) ** 2 * mask).sum()
    loss = -(objective * mask).sum() / mask.sum().clamp(min=1.0) + penalty
    return loss, {"custom/penalty:sum": penalty, "custom/clipped:mean": ((ratio != clipped).float() * mask).sum()}


def rl_batches(sequences: list[tuple[list[int], list[int]]], batch: int, seed: int) -> list[tuple[list, int]]:
    """Datums as an RL loop makes them from (ids, labels): the sampler's logprobs, an advantage a sequence on its
    completion (the labelled tokens), and its mask; with the tokens each batch sends through the base."""
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, len(sequences) - batch + 1, batch):
        data, tokens = [], 0
        for ids, labels in sequences[start:start + batch]:
            mask = np.array([0.0 if label == -100 else 1.0 for label in labels[1:]], dtype=np.float32)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
                "target_tokens": np.array(ids[1:], dtype=np.int64),
                "logprobs_old": (-rng.random(len(mask)) * 3).astype(np.float32),
                "advantages": (mask * float(rng.normal())).astype(np.float32), "mask": mask}))
            tokens += len(ids) - 1
        out.append((data, tokens))
    return out


def run(url: str, base_name: str, rank: int, batches: list, warmup: int, rounds: int, server) -> dict:
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-5)
    with tinker.ServiceClient(base_url=url, api_key="tml-user0") as service:
        handle = service.create_custom_loss(clipped_pg, {"logprobs": 1, "logprobs_old": 1, "advantages": 1,
                                                         "mask": 1}).result()
        if handle.loss_id is None:
            raise SystemExit("the server does not run custom losses (its client config's custom_loss_server_side)")
        losses = {"server": handle, "client": dataclasses.replace(handle, loss_id=None)}
        models = {side: service.create_lora_training_client(base_model=base_name, rank=rank, seed=1).result()
                  for side in SIDES}
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        metrics: dict[str, list[float]] = {side: [] for side in SIDES}
        passes: dict[str, int] = {side: 0 for side in SIDES}
        order = [side for index in range(rounds) for side in (SIDES if index % 2 == 0 else SIDES[::-1])]
        steps = len(batches) // rounds
        position = {side: 0 for side in SIDES}
        for turn, side in enumerate(order):
            first = server.pass_count()
            for _ in range(steps):
                data, _tokens = batches[position[side]]
                started = time.perf_counter()
                backward = models[side].forward_backward_custom(data, losses[side])
                stepped = models[side].optim_step(adam)
                output = backward.result()
                stepped.result()
                if position[side] >= warmup:
                    times[side].append(time.perf_counter() - started)
                metrics[side].append(output.metrics["loss:sum"])
                position[side] += 1
            passes[side] += server.pass_count() - first
            print(f"[custom_loss] turn {turn + 1}/{len(order)} {side}: median step so far "
                  f"{statistics.median(times[side]) if times[side] else float('nan'):.3f} s", flush=True)
    agree = metrics["server"] == metrics["client"]
    report = {side: {"median_step_s": statistics.median(times[side]), "steps": len(times[side]),
                     "passes_per_step": passes[side] / position[side]} for side in SIDES}
    report.update(client_over_server=report["client"]["median_step_s"] / report["server"]["median_step_s"],
                  losses_agree=agree, losses={side: metrics[side] for side in SIDES})
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="smollm2-135m", help="smollm2-135m (shipped) or tiny (a random 2-layer one)")
    parser.add_argument("--steps", type=int, default=6, help="steps a side a round, warm-up included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="sequences a step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tokenizer = tinker_peers.smollm2_tokenizer()
    with tempfile.TemporaryDirectory(prefix="tinker-custom-loss-") as scratch:
        folder = Path(scratch)
        base = tinker_peers.SMOLLM2 if args.base == "smollm2-135m" else str(
            tinker_peers.tiny_base_folder(folder / "tiny", tokenizer))
        count = args.steps * args.rounds * args.batch
        rows, fmt = tinker_peers.make_rows(None, count, tokenizer)
        sequences = tinker_peers.tokenized(rows, fmt, tokenizer, tinker_peers.MAX_SEQ_LEN)
        batches = rl_batches(sequences, args.batch, seed=0)
        server = tinker_clients.Server("fused", base, args.base, folder, window_s=0.005, threads=0)
        try:
            report = run(server.ready()["url"], args.base, args.rank, batches, args.warmup, args.rounds, server)
        finally:
            server.stop()
    report["settings"] = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    print(f"[custom_loss] median step: server {report['server']['median_step_s']:.3f} s, client "
          f"{report['client']['median_step_s']:.3f} s: the client-side way takes "
          f"{report['client_over_server']:.2f}x as long; passes a step {report['server']['passes_per_step']:.1f} / "
          f"{report['client']['passes_per_step']:.1f}; losses agree bit for bit: {report['losses_agree']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["losses_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
