"""The processes bench/tinker_clients.py compares, each run as `python bench/tinker_peers.py ROLE ...` in a
process of its own: `serve` (the Tinker API on one base, as docs/tinker.md serves it: InteractiveCalls +
TinkerBackend + tinker_router under uvicorn; `--sliced` serves one model's call per pass with no window, the
time-sliced way) and `lone` (one aspen job on the same base and data, through `train_locally`, the path of
`aspen run --in-process`). Also the bench's shared pieces: the tiny base, the data, the token count."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMOLLM2 = "smollm2-135m"
PROMPT_RESPONSE = {"type": "prompt_response", "prompt": "Question: {question}\nAnswer:", "response": " {answer}"}
TEXT = {"type": "text", "field": "text"}
RANDOM_LENGTHS = (64, 320)     # random rows' token lengths, as GSM8K's (mean 185, p95 316 with this tokenizer)
MAX_SEQ_LEN = 512
LORA_ALPHA = 32                # the Tinker adapter's (actors/engine/interactive_model.py), given to the lone job too


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def smollm2_tokenizer():
    """SmolLM2's tokenizer, from the base's converted folder (actors/storage/gguf_cache.py: built once)."""
    from actors.storage.gguf_cache import converted_source
    from actors.storage.sources import load_tokenizer, resolve_source

    return load_tokenizer(converted_source(resolve_source(SMOLLM2)))


def tiny_base_folder(folder: Path, tokenizer) -> Path:
    """A tiny random Llama (the tests' config: 2 layers of width 64) with `tokenizer` (SmolLM2's), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_SEQ_LEN,
                         tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_rows(data: Path | None, count: int, tokenizer, seed: int = 0) -> tuple[list[dict], dict]:
    """`count` rows and their format: GSM8K's (question -> answer) when `data` is given, else texts of random
    tokens of 64-320 tokens."""
    rng = random.Random(seed)
    if data is not None:
        rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
        if len(rows) < count:
            raise SystemExit(f"{data} has {len(rows)} rows; this run needs {count}: fewer clients or steps")
        rng.shuffle(rows)
        return [{"question": r["question"], "answer": r["answer"]} for r in rows[:count]], PROMPT_RESPONSE
    vocab = len(tokenizer)
    rows = [{"text": tokenizer.decode([rng.randrange(3, vocab) for _ in range(rng.randint(*RANDOM_LENGTHS))])}
            for _ in range(count)]
    return rows, TEXT


def tokenized(rows: list[dict], fmt: dict, tokenizer, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Each row's (input ids, labels) as an aspen job tokenizes it (actors/data/tokenize.py)."""
    from pydantic import TypeAdapter

    from actors.data.formats import DataFormat
    from actors.data.tokenize import tokenize_example

    parsed = TypeAdapter(DataFormat).validate_python(fmt)
    out = []
    for row in rows:
        example = tokenize_example(row, parsed, tokenizer, max_seq_len=max_seq_len)
        if example is not None:
            out.append((list(example.input_ids), list(example.labels)))
    return out


def linear_parameters(model: torch.nn.Module) -> int:
    """Weights of the base's matrix multiplications (every nn.Linear, the LM head included): a token's forward
    costs 2 FLOPs per weight, and its backward to the activations (the base frozen) 2 more."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


# -- serve ------------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from fastapi import FastAPI

    from actors.engine.models import load_base_model
    from actors.service.trainer.interactive_calls import InteractiveCalls
    from orchestrator.tinker.tinker_routes import TinkerBackend, tinker_router

    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_base_model(args.base)
    passes = open(args.passes, "a")   # open while the server runs; each pass a line

    def record(step: dict) -> None:
        passes.write(json.dumps(step) + "\n")
        passes.flush()

    calls = InteractiveCalls(base, window_s=0.0 if args.sliced else args.window_s,
                             max_models_per_pass=1 if args.sliced else None, on_step=record)
    # beside the passes file, in the caller's folder, which the caller removes: uvicorn re-raises the SIGTERM that
    # stops this server once it has shut down, so the `finally` below does not run then
    weights = Path(tempfile.mkdtemp(prefix="tinker-bench-weights-", dir=Path(args.passes).parent))
    backend = TinkerBackend(calls, args.name, weights, lambda token: token if token.startswith("user") else None)
    app = FastAPI()
    app.include_router(tinker_router(backend.start()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    info = {"url": f"http://127.0.0.1:{sock.getsockname()[1]}", "linear_parameters": linear_parameters(base.model),
            "dtype": str(next(base.model.parameters()).dtype), "threads": torch.get_num_threads()}
    print("READY " + json.dumps(info), flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)).run(sockets=[sock])
    finally:
        backend.close()
        shutil.rmtree(weights, ignore_errors=True)


# -- lone ---------------------------------------------------------------------------------------------------
def lone(args: argparse.Namespace) -> None:
    """One aspen job: `steps` optimizer steps of `batch` sequences of the rows in `--rows`; its steps' tokens
    (padding left out) and end times, written to `--out`. The base is loaded first (as `train_locally` loads
    it), then "READY" printed; the job starts when a line comes on stdin."""
    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.job_submission import canonical_base_model
    from actors.spec.run_spec import RunSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_base_model(canonical_base_model(args.base))
    print("READY", flush=True)
    sys.stdin.readline()
    out_dir = Path(tempfile.mkdtemp(prefix="tinker-bench-lone-"))   # removed when the job has ended
    job = {"name": "lone", "data": args.rows, "format": json.loads(Path(args.format_file).read_text()),
           "batch_size": args.batch, "lr": 1e-4, "lr_schedule": "constant", "max_steps": args.steps,
           "max_seq_len": args.max_seq_len, "max_grad_norm": None, "checkpoint_every": 10**6,
           "lora": {"r": args.rank, "alpha": LORA_ALPHA, "target_modules": "all-linear"}}
    spec = RunSpec.model_validate({"base_model": args.base, "output_dir": str(out_dir), "jobs": [job]})
    steps: list[dict] = []
    started = time.perf_counter()

    def on_step(report) -> None:
        steps.append({"end": time.perf_counter() - started, "tokens": report.tokens - report.padding_tokens,
                      "sequences": len(report.sequence_lengths), "seconds": report.seconds})

    try:
        (summary,) = train_locally(spec, base=base, progress=False, on_step=on_step)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if summary.state != "completed":
        raise SystemExit(f"the lone job ended {summary.state}: {summary.reason}")
    Path(args.out).write_text(json.dumps({"steps": steps, "threads": torch.get_num_threads(),
                                          "first_loss": summary.first_loss, "final_loss": summary.final_loss}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    server = roles.add_parser("serve")
    server.add_argument("--base", required=True)
    server.add_argument("--name", required=True, help="the base's name as clients give it")
    server.add_argument("--passes", required=True, help="a JSON line per pass is appended here")
    server.add_argument("--sliced", action="store_true")
    server.add_argument("--window-s", type=float, default=0.005)
    server.add_argument("--threads", type=int, default=0)
    job = roles.add_parser("lone")
    for name in ("--base", "--rows", "--format-file", "--out"):
        job.add_argument(name, required=True)
    for name in ("--batch", "--steps", "--rank", "--max-seq-len"):
        job.add_argument(name, type=int, required=True)
    job.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    (serve if args.role == "serve" else lone)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
