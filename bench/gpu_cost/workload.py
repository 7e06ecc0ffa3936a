"""The steps the model predicts, run by a checkout's own engine on the virtual device (`virtual_cuda`) under
the recorder: the benchmark's fused jobs (bench/lora_mfu.py's aspen side, as ../shared/gpu/profile_step.py
ran it for the 2026-11-28 profile), its fusion sweep (N adapters, equal tokens), and the frozen base alone
(profile_step.py's second measurement). Shapes, job batches and the LoRA config come from the checkout's
bench/lora_bench.py (SHAPES, job_batches, JOBS, SEQUENCES_PER_JOB, MAX_LEN, LORA; bench/lora_mfu.py in
older checkouts), smollm2-135m's shape from here where that file lacks it. Import this module in a process whose
`actors` is the checkout's (`gpu_cost_model.py` runs one process per checkout)."""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
from ast import literal_eval
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from gpu_cost.operations import Op
from gpu_cost.recorder import KernelRecorder
from gpu_cost.virtual_cuda import CUDA, VirtualCuda

EXTRA_SHAPES = {   # LlamaConfig fields of shapes bench/lora_mfu.py may lack
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
}
# profile_step.py: 2 warm-up steps, 4 timed (their median: the measured step), 2 profiled; bench/lora_mfu.py
# (then) timed steps 2-7 for its tokens/s
STEPS, TIMED, THROUGHPUT, PROFILED = 8, range(2, 6), range(2, 8), range(6, 8)
WARMUP = 2   # bench/lora_mfu.py's warm-up steps (since: 20 timed steps after them, in order, CUDA-event timed)
FUSION_SEQUENCES, FUSION_LENGTH = 32, 128


@dataclass
class Recorded:
    steps: list[list[Op]]
    tokens: list[int]                       # real tokens per step
    matmul_parameters: int
    unknown_values: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def benchmark_module(checkout: Path) -> ModuleType:
    """What the checkout's bench/lora_mfu.py runs its sides with (its shapes and job batches), loaded from its
    file: bench/lora_bench.py, or bench/lora_mfu.py itself in a checkout from before 2026-12-01 (e.g. the
    profiled 70c0645), under its own name, so that the checkout's peft_baselines.py imports it and
    --set lora_bench:ATTR=value (lora_mfu:ATTR there) reaches it."""
    bench = checkout / "bench"
    path = next((p for p in (bench / "lora_bench.py", bench / "lora_mfu.py") if p.exists()), None)
    if path is None:
        raise FileNotFoundError(f"neither {bench / 'lora_bench.py'} nor {bench / 'lora_mfu.py'} found: the "
                                "workload's shapes and batches come from the checkout's bench/lora_bench.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[path.stem] = module
    return module


# libraries that look at the device when first imported (bitsandbytes loads its CUDA backend if
# torch.cuda.is_available(); Liger picks its implementation by the device): imported before the virtual device
# exists, so that they see this machine as it is
OPTIONAL_IMPORTS = ("peft", "bitsandbytes", "liger_kernel.ops", "liger_kernel.transformers",
                    "liger_kernel.transformers.functional")


def preimport() -> list[str]:
    """Import OPTIONAL_IMPORTS where installed; the names imported."""
    found = []
    for name in OPTIONAL_IMPORTS:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except (ImportError, AttributeError, RuntimeError, OSError) as error:   # absent or broken: the step decides
            print(f"[gpu_cost] {name} not imported ({error}); the step imports it itself if it needs it",
                  file=sys.stderr)
            continue
        found.append(name)
    return found


def shapes(bench: ModuleType) -> dict[str, dict]:
    return {**EXTRA_SHAPES, **bench.SHAPES}


def apply_settings(settings: list[str]) -> list[str]:
    """`module:ATTR=value` (the value a Python literal, else a string): set before the steps run."""
    applied = []
    for setting in settings:
        target, _, text = setting.partition("=")
        module_name, _, attribute = target.partition(":")
        if not (module_name and attribute and _):
            raise ValueError(f"--set {setting!r}: expected module:ATTR=value "
                             "(e.g. actors.engine.lora_grouped:GROUPING=segments)")
        module = importlib.import_module(module_name)
        if not hasattr(module, attribute):
            raise ValueError(f"--set {setting!r}: {module_name} has no attribute {attribute}")
        try:
            value: Any = literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(module, attribute, value)
        applied.append(f"{module_name}.{attribute} = {value!r}")
    return applied


def _model(shape: dict, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(CUDA):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    return model.eval()


def _matmul_parameters(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


class Session:
    """A virtual device and its recorder, entered once per process."""

    def __init__(self, card_name: str):
        self.recorder = KernelRecorder()
        self.device = VirtualCuda(self.recorder, name=card_name)
        self.recorder.attach(self.device)

    def __enter__(self) -> Session:
        self.device.__enter__()
        self.recorder.__enter__()
        ACTIVE.append(self.recorder)
        return self

    def __exit__(self, *exc: Any) -> None:
        ACTIVE.remove(self.recorder)
        self.recorder.__exit__(*exc)
        self.device.__exit__(*exc)

    def record(self, run: Any) -> tuple[Any, list[Op]]:
        self.recorder.recording = True
        self.recorder.python.count = 0
        previous = sys.getprofile()
        sys.setprofile(self.recorder.python)
        try:
            result = run()
        finally:
            sys.setprofile(previous)
            self.recorder.recording = False
        return result, self.recorder.take()


KERNELS: str | None = None   # from_module's `kernels` (auto | liger | none) where the checkout has it (--kernels)


def _base(model: torch.nn.Module) -> Any:
    """The checkout's BaseModel of `model` (from_module), with `kernels` where asked and known."""
    import inspect

    from actors.engine.models import from_module

    if KERNELS is not None and "kernels" in inspect.signature(from_module).parameters:
        return from_module(model, None, kernels=KERNELS)
    if KERNELS is not None:
        raise ValueError(f"--kernels {KERNELS}: this checkout's from_module has no kernels setting")
    return from_module(model, None)


FIXED_SHAPES = False   # aspen's steps in compile: graphs' fixed shapes, run eagerly (--fixed-shapes)
GRAPH_SPAN = "graph span"   # the name of the marks around what compile: graphs captures
ACTIVE: list[KernelRecorder] = []   # the session's recorder (Session.__enter__)


def _mark(which: str) -> None:
    """A mark in the recorded step (no host cost, no kernel): where compile: graphs' capture begins or ends."""
    if ACTIVE and ACTIVE[-1].recording:
        ACTIVE[-1]._append(Op(GRAPH_SPAN, "host", detail={"graph_span": which, "graphed": True}))


class _EagerFixed:
    """compile: graphs' backend that never captures (the virtual device has no graphs): each step runs eagerly in
    its fixed shape, what a capture would record, between two marks (`GRAPH_SPAN`: predict.graphed replays exactly
    that part of the step)."""

    def warm(self, run: Any) -> Any:
        _mark("begin")
        out = run()
        _mark("end")
        return out

    def capture(self, run: Any) -> Any:
        raise RuntimeError("no capture on the virtual device (bench/gpu_cost_model.py --fixed-shapes: each step eager)")

    def replay(self, graph: Any) -> None:
        raise RuntimeError("no replay on the virtual device")


def _trainer(base: Any) -> Any:
    from actors.engine.trainer import FusedTrainer

    if not FIXED_SHAPES:
        return FusedTrainer(base, step_tokens=1 << 17)
    # its capture refuses at once: the shape is left eager (said once), every step run as the capture would record it
    return FusedTrainer(base, step_tokens=1 << 17, compile="graphs", graph_backend=_EagerFixed())


def _add_job(trainer: Any, base: Any, bench: ModuleType, name: str, examples: list, batch_size: int,
             steps: int, seed: int, max_len: int | None) -> Any:
    from actors.engine.job import TrainingJob

    JobSpec = from_checkout("actors.spec.job_spec", "actors.engine.spec").JobSpec
    extra = {"max_seq_len": max_len} if max_len else {}
    spec = JobSpec(name=name, data="unused.jsonl", format={"type": "text"}, batch_size=batch_size,
                   max_steps=steps, lr=1e-4, lora=bench.LORA, **extra)
    job = TrainingJob.create(spec, base, examples, [], seed=seed)
    trainer.add_job(job)
    return job


class InOrder:
    """A job's micro-batches in a fixed order (a BatchSource), as bench/lora_mfu.py's aspen side feeds them."""

    def __init__(self, batches: list[list]):
        self.batches, self.position = batches, 0

    @property
    def exhausted(self) -> bool:
        return self.position >= len(self.batches)

    def next_batch(self) -> list | None:
        if self.exhausted:
            return None
        self.position += 1
        return self.batches[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def record_jobs(session: Session, bench: ModuleType, shape: str, jobs: int, steps: int = STEPS,
                in_order: bool = False) -> Recorded:
    """`jobs` jobs of SEQUENCES_PER_JOB sequences of 64-768 tokens a step (bench/lora_mfu.py's job_batches),
    every step all of them, packed; each step recorded. As profile_step.py ran it for the 2026-11-28 profile
    (each job's batches through its DataCursor), or `in_order` as bench/lora_mfu.py's aspen side runs it since
    (step k takes every job's k-th batch)."""
    from actors.engine.job import TrainingJob

    Example = from_checkout("actors.data", "actors.engine.data").Example
    JobSpec = from_checkout("actors.spec.job_spec", "actors.engine.spec").JobSpec
    config = shapes(bench)[shape]
    model = _model(config, torch.bfloat16)
    base = _base(model)
    trainer = _trainer(base)
    for job in range(jobs):
        batches = bench.job_batches(job, steps, config["vocab_size"])
        if not in_order:
            examples = [Example(tuple(ids), tuple(labels)) for batch in batches for ids, labels in batch]
            _add_job(trainer, base, bench, f"job-{job}", examples, bench.SEQUENCES_PER_JOB, steps, job,
                     bench.MAX_LEN)
            continue
        source = InOrder([[Example(tuple(ids), tuple(labels)) for ids, labels in batch] for batch in batches])
        spec = JobSpec(name=f"job-{job}", data="unused.jsonl", format={"type": "text"}, batch_size=len(batches[0]),
                       max_steps=steps, lr=1e-4, lora=bench.LORA, max_seq_len=bench.MAX_LEN)
        trainer.add_job(TrainingJob.attach(spec, base, source, [], steps, seed=job))
    recorded = Recorded([], [], _matmul_parameters(model))
    for _ in range(steps):
        report, ops = session.record(trainer.train_step)
        recorded.steps.append(ops)
        recorded.tokens.append(report.tokens - report.padding_tokens)
    recorded.unknown_values = sorted(session.recorder.unknown_values)
    return recorded


FUSION_WARMUP = 2   # bench/lora_mfu.py's fusion side's warm-up steps (its --warmup)


def record_fusion(session: Session, bench: ModuleType, shape: str, adapters: list[int],
                  steps: int = FUSION_WARMUP + 2) -> dict[int, Recorded]:
    """bench/lora_mfu.py's fusion side: FUSION_SEQUENCES sequences of FUSION_LENGTH tokens a step split evenly
    over N adapters; the first FUSION_WARMUP steps are warm-ups, as there (the optimizer state allocated, the
    kernels checked, kept tables made)."""
    Example = from_checkout("actors.data", "actors.engine.data").Example
    config = shapes(bench)[shape]
    model = _model(config, torch.bfloat16)
    base = _base(model)
    rng = random.Random(0)
    out = {}
    for count in adapters:
        trainer = _trainer(base)
        per_job = FUSION_SEQUENCES // count
        names = []
        for job in range(count):
            examples = []
            for _ in range(per_job * steps):
                ids = [rng.randrange(3, config["vocab_size"]) for _ in range(FUSION_LENGTH)]
                examples.append(Example(tuple(ids), tuple(ids)))
            names.append(f"f{count}-{job}")
            _add_job(trainer, base, bench, names[-1], examples, per_job, steps, job, None)
        recorded = Recorded([], [], _matmul_parameters(model))
        for _ in range(steps):
            report, ops = session.record(trainer.train_step)
            recorded.steps.append(ops)
            recorded.tokens.append(report.tokens - report.padding_tokens)
        for name in names:
            trainer.remove_job(name)
        out[count] = recorded
    return out


def record_base(session: Session, bench: ModuleType, shape: str, steps: int = STEPS) -> Recorded:
    """profile_step.py's frozen base alone: the HF model over the same packed tokens (one row, position ids
    restarting, sdpa over the whole row as HF runs it without a mask), float32 cross-entropy over every
    token, input-gradient backward, no LoRA; the 4 jobs' batches of each step."""
    config = shapes(bench)[shape]
    model = _model(config, torch.bfloat16)
    model.requires_grad_(False)
    embeddings = model.get_input_embeddings()
    batches = {job: bench.job_batches(job, steps, config["vocab_size"]) for job in range(bench.JOBS)}
    recorded = Recorded([], [], _matmul_parameters(model))
    recorded.notes.append("sdpa as CUDA runs it: flash without a mask, memory-efficient with transformers' "
                          "block-diagonal mask of the packed row")

    def step(index: int) -> int:
        ids, positions = [], []
        for job in range(bench.JOBS):
            for sequence, _ in batches[job][index]:
                ids += sequence
                positions += list(range(len(sequence)))
        ids_t = torch.tensor([ids], device=CUDA)
        positions_t = torch.tensor([positions], device=CUDA)
        x = embeddings(ids_t).detach().requires_grad_(True)
        logits = model(inputs_embeds=x, position_ids=positions_t, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids_t.view(-1))
        loss.backward()
        torch.cuda.synchronize()
        return len(ids)

    with flash_sdpa():
        for index in range(steps):
            tokens, ops = session.record(lambda index=index: step(index))
            recorded.steps.append(ops)
            recorded.tokens.append(tokens)
    return recorded


class flash_sdpa:
    """F.scaled_dot_product_attention on the virtual device as CUDA runs it in bf16 (the meta device would take
    the math path, a T x T score matrix in memory): without a mask the flash kernel; with one (transformers
    builds a block-diagonal mask from the position ids of a packed row) the memory-efficient kernel over an
    additive bias made from it, every score computed. Keys and values are repeated for grouped heads."""

    def __enter__(self) -> None:
        self.original = F.scaled_dot_product_attention

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            if dropout_p or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
                return self.original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            groups = query.shape[1] // key.shape[1]
            if groups > 1:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
            if attn_mask is None:
                return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal,
                                                                          False, scale=scale)[0]
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                    attn_mask.logical_not(), float("-inf"))
            bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, 0.0,
                                                                          is_causal, scale=scale)[0]

        F.scaled_dot_product_attention = sdpa

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = self.original


def from_checkout(*names: str) -> ModuleType:
    """The first of these modules that the checkout's own `actors` package holds: modules moved between commits
    (actors.data and actors.spec were actors.engine.data and actors.engine.spec before ffcab51), and this
    repository's editable install would hand an older checkout this checkout's module of the new name."""
    import actors

    root = Path(actors.__file__).resolve().parent.parent
    for name in names:
        path = root.joinpath(*name.split("."))
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return importlib.import_module(name)
    raise ImportError(f"the checkout {root} has none of {', '.join(names)}")


def check_checkout(checkout: Path) -> None:
    """`actors` must be the checkout's (sys.path set by the caller)."""
    import actors

    where = Path(actors.__file__).resolve()
    if checkout.resolve() not in where.parents:
        raise RuntimeError(f"actors was imported from {where}, not from the checkout {checkout}: put the checkout "
                           "first on sys.path (gpu_cost_model.py runs each checkout in its own process)")
