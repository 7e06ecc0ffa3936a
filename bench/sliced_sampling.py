#!/usr/bin/env python
"""A Tinker user's training loop on a trainer while another user's long sampling decodes: with the sampling decoded
in slices (`interactive_sample_slice_s`, the trainer's other work between them) against decoded whole (null: the
trainer busy till it ends), on one base in one process, as a trainer's interactive calls run them
(`InteractiveCalls` with its stepping thread).

User A sends one sampling call (`--samples` continuations of `--max-tokens` tokens, the length never cut short: no
stop token); half a second later user B runs `--steps` training steps (forward_backward of two datums of `--tokens`
random tokens, then optim_step, each awaited, as tinker-cookbook's loops do). Reported per mode: B's loop time, A's
sampling time, and B's loop alone (no sampling beside it) as the floor. The ratios: B's loop decoded-whole /
sliced (what slicing gives B), A's sampling sliced / whole (what it costs A: B's passes run between its slices).
The modes alternate over `--rounds` so that the machine's drift does not favour one.

    python bench/sliced_sampling.py [--base smollm2-135m|tiny] [--samples 4] [--max-tokens 192] [--steps 4]
        [--tokens 128] [--slice-s 1.0] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
import tinker_peers


def base_model(name: str, folder: Path):
    from actors.engine.models import load_base_model

    if name == "tiny":
        return load_base_model(str(tinker_peers.tiny_base_folder(folder / "tiny", tinker_peers.smollm2_tokenizer())),
                               dtype="float32", device="cpu")
    return load_base_model(name, dtype="float32", device="cpu")


def training_call(name: str, vocab: int, tokens: int, seed: int):
    from actors.engine.interactive_step import CallDatum, ModelCall

    generator = torch.Generator().manual_seed(seed)
    return ModelCall(name, tuple(CallDatum(tuple(torch.randint(3, vocab, (tokens,), generator=generator).tolist()),
                                           {"target_tokens": torch.randint(3, vocab, (tokens,), generator=generator),
                                            "weights": torch.ones(tokens)}) for _ in range(2)))


def one_run(base, slice_s: float | None, args: argparse.Namespace, sampling: bool, round_: int) -> dict:
    from actors.engine.interactive_model import AdamStep
    from actors.engine.tinker_sampling import SampleCall
    from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name

    vocab = int(base.lm_head.weight.shape[0])
    calls = InteractiveCalls(base, sample_slice_s=slice_s)
    stepper = threading.Thread(target=calls.run, daemon=True)
    stepper.start()
    model = f"b-{round_}-{slice_s}-{sampling}"
    calls.create_model(model, 16, seed=round_)
    try:
        started = time.perf_counter()
        sampled = None
        if sampling:
            sampled = calls.submit_sample(SampleCall(None, tuple(range(5, 69)), num_samples=args.samples,
                                                     max_tokens=args.max_tokens, temperature=1.0, seed=round_))
            time.sleep(0.5)
        loop_started = time.perf_counter()
        for step in range(args.steps):
            calls.submit(model, 2 * step + 1, "forward_backward",
                         training_call(adapter_name(model), vocab, args.tokens, step)).result(timeout=3600)
            calls.submit(model, 2 * step + 2, "optim_step", AdamStep(learning_rate=1e-4)).result(timeout=3600)
        loop_s = time.perf_counter() - loop_started
        sample_s = None
        if sampled is not None:
            result = sampled.result(timeout=3600)
            sample_s = time.perf_counter() - started
            assert all(len(s.tokens) == args.max_tokens for s in result.sequences)
        return {"loop_s": loop_s, "sample_s": sample_s}
    finally:
        calls.remove_model(model)
        calls.close()
        stepper.join(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=tinker_peers.SMOLLM2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slice-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        base = base_model(args.base, Path(folder))
        one_run(base, None, argparse.Namespace(**{**vars(args), "steps": 1, "max_tokens": 4}), True, -1)   # warm-up
        runs: dict[str, list[dict]] = {"sliced": [], "whole": [], "alone": []}
        for round_ in range(args.rounds):
            order = [("sliced", args.slice_s), ("whole", None)]
            for mode, slice_s in order if round_ % 2 == 0 else order[::-1]:
                runs[mode].append(one_run(base, slice_s, args, True, round_))
                print(f"round {round_} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
            runs["alone"].append(one_run(base, None, args, False, round_))
    median = {mode: {key: statistics.median(r[key] for r in rows) if rows[0][key] is not None else None
                     for key in rows[0]} for mode, rows in runs.items()}
    report = {"base": args.base, "samples": args.samples, "max_tokens": args.max_tokens, "steps": args.steps,
              "tokens": args.tokens, "slice_s": args.slice_s, "rounds": args.rounds, "median": median,
              "loop_whole_over_sliced": median["whole"]["loop_s"] / median["sliced"]["loop_s"],
              "loop_sliced_over_alone": median["sliced"]["loop_s"] / median["alone"]["loop_s"],
              "sampling_sliced_over_whole": median["sliced"]["sample_s"] / median["whole"]["sample_s"]}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
