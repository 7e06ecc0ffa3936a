"""What bench/lora_mfu.py's sides share (bench/lora_sides.py, bench/fusion_side.py, bench/peft_baselines.py,
bench/lora_report.py, and bench/gpu_cost's model of them): the shapes, the LoRA and job settings, issue 47's goals,
random models of a shape, each job's batches and a source that gives them in order, a step clock that never waits
inside the timed steps, and the figures a side reports (its result file, the engine's chosen settings)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch

SHAPES = {   # LlamaConfig fields
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
    "tiny-tied": dict(vocab_size=1024, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048,
                      tie_word_embeddings=True),
}
QUICK_SHAPES = {"llama-3.1-8b": "tiny", "smollm2-135m": "tiny-tied"}   # --quick: each shape's stand-in
QUICK_LENGTHS = (16, 96)   # --quick: sequences of 16-96 tokens
# dense bf16 peak FLOP/s without sparsity, from the vendors' data sheets
PEAKS = {"H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 PCIe": 756.0e12, "H100 NVL": 835.0e12,
         "H200": 989.4e12, "A100": 312.0e12, "L40S": 362.0e12}
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
# 4 jobs x 2 sequences of 64-768 tokens: 2.0k-3.9k tokens a fused step. On an H100 (2026-11-27) a step took
# ~13 MB a token for this shape (bf16 layers ~6.5 MB, the adapted modules' inputs cast to the adapters'
# float32 ~5 MB, the 128k-vocabulary logits ~1.5 MB); the bf16 path should need ~8 MB
JOBS, SEQUENCES_PER_JOB, MIN_LEN, MAX_LEN = 4, 2, 64, 768
PEFT_SEQUENCES_PER_STEP = 8      # (a): one job's 8 sequences a step, as many as a fused step holds of 4 jobs
FUSION_ADAPTERS = (1, 2, 4, 8, 16, 32)
SIDES = ("aspen", "peft", "packed", "frozen", "concurrent")   # the order they run in: what they tell
OPTIONAL_SIDES = ("graphs",)   # run where asked (--sides): aspen's steps as replayed CUDA graphs (host-bound shapes)
SIDE_NAMES = {"aspen": "aspen, 4 jobs fused", "graphs": "aspen, compile: graphs (replayed CUDA graphs)",
              "peft": "(a) PEFT loop, padded, jobs in turn",
              "packed": "(b) PEFT packed varlen (+Liger)", "concurrent": "(c) 4 PEFT processes at once",
              "frozen": "frozen base alone (ceiling)"}
# issue 47's goals (an H100 or H200, measured side by side in one lease)
GOALS = {"lora_mfu": 0.45, "lora_mfu_next": 0.50, "over_peft": 2.0, "over_packed": 1.2, "fusion_8": 0.95,
         "fusion_32": 0.90, "small_over_peft": 1.3, "gpu_busy": 0.95, "cost_model_error": 0.20}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    with torch.device(device):   # built in `dtype` on the device: no float32 copy of an 8B model
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype)
    return model.eval()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAKS.items() if key in name), None)


def matmul_parameters(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def job_batches(job: int, steps: int, vocab: int, min_len: int = MIN_LEN,
                max_len: int = MAX_LEN) -> list[list[tuple[list[int], list[int]]]]:
    """Each step's micro-batch of one job: SEQUENCES_PER_JOB sequences of MIN_LEN..MAX_LEN tokens, the first
    quarter prompt (labels -100)."""
    rng = random.Random(job)
    batches = []
    for _ in range(steps):
        batch = []
        for _ in range(SEQUENCES_PER_JOB):
            length = rng.randint(min_len, max_len)
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            batch.append((ids, [-100] * (length // 4) + ids[length // 4:]))
        batches.append(batch)
    return batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class StepClock:
    """Each step's duration from CUDA events recorded between steps, read after the last one: no host sync
    inside the timed steps, so a trainer that overlaps its next step's host work with this one's GPU work
    keeps doing so, and a step's time includes the GPU's idle gaps. On a CPU, the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def step_summary(seconds: list[float], tokens: list[int]) -> dict:
    """Median, p10 and p90 step; real tokens/s over all timed steps (their tokens over their seconds)."""
    ordered = sorted(seconds)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"steps": len(seconds), "median_step_s": statistics.median(seconds), "p10_step_s": quantile(0.1),
            "p90_step_s": quantile(0.9), "tokens": sum(tokens), "seconds": sum(seconds),
            "tokens_per_s": sum(tokens) / sum(seconds), "step_seconds": [round(s, 5) for s in seconds],
            "step_tokens": tokens}


def memory_fields(device: torch.device, before_steps: int = 0, largest_step_tokens: int = 0) -> dict:
    """The allocator's peak, the memory held before the timed steps, and the step's bytes a token."""
    if device.type != "cuda":
        return {"peak_memory_bytes": None}
    peak = int(torch.cuda.max_memory_allocated(device))
    fields = {"peak_memory_bytes": peak, "held_before_steps_bytes": before_steps,
              "card_memory_bytes": torch.cuda.get_device_properties(device).total_memory}
    if largest_step_tokens:
        fields["step_bytes_per_token"] = (peak - before_steps) / largest_step_tokens
    return fields


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_events(device: torch.device) -> dict[str, int]:
    """CUDA's caching allocator's counters that mean a wait (a retry after freeing its cache, a cudaMalloc or
    cudaFree: each synchronises the device); the difference over the timed steps says whether a step waited on
    them (a fragmented cache at many adapters, say). Empty off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_EVENTS}


def allocator_events_since(device: torch.device, before: dict[str, int]) -> dict:
    after = allocator_events(device)
    return {"allocator_events_in_timed_steps": {name: after[name] - before.get(name, 0) for name in after}} \
        if after else {}


def with_mfu(result: dict, model, device: torch.device, ceiling: float | None = None) -> dict:
    flops = 4 * matmul_parameters(model) * result["tokens_per_s"]
    peak = peak_flops(device)
    return {**result, "matmul_parameters": matmul_parameters(model), "flops_per_s": flops,
            "lora_mfu": flops / peak if peak else None, "peak_flops": peak,
            "lora_mfu_of_ceiling": flops / ceiling if ceiling else None}


def write(args: argparse.Namespace, result: dict) -> None:
    if args.result:
        args.result.write_text(json.dumps(result))


class ListSource:
    """A job's micro-batches in a fixed order (a BatchSource): every side trains the same sequences."""

    def __init__(self, batches: list[list]):
        self.batches, self.position = batches, 0

    @property
    def exhausted(self) -> bool:
        return self.position >= len(self.batches)

    def next_batch(self):
        if self.exhausted:
            return None
        self.position += 1
        return self.batches[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def engine_settings(trainer) -> dict:
    """What the engine chose on this device (for the report: the defaults measured)."""
    import actors.engine.lora_grouped as lora_grouped
    settings = {"recompute": getattr(trainer, "recompute", None), "layout": getattr(trainer, "layout", None),
                "dtype": str(getattr(trainer.base, "dtype", None)),
                "lora_grouping": getattr(lora_grouped, "GROUPING", None)}
    try:   # the kernel each tuned LoRA product's shape took, measured during the first steps
        from actors.engine import kernel_tuning
    except ImportError:   # a checkout from before it (the cost model runs older checkouts' benchmarks)
        return settings
    return {**settings, "tuned_kernels": kernel_tuning.decisions()}
