"""Part (b) of bench/fusion.py: the share of padding in the tokens a fused step processes on real data
(GSM8K + Code Alpaca, micro-batches of 8 per job, both jobs in every step) for the layouts `packed`, `padded`
and `padded_fused`, and mLoRA's `padded_fused` with MinPad choosing the jobs of each step: counting only."""

from __future__ import annotations

import time
from pathlib import Path

from actors.data import AlpacaFormat, DataCursor, Example, PromptResponseFormat, load_examples
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch, pack
from bench.fusion_jobs import fmt_pct, log

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO.parent / "shared" / "data"
GSM8K = DATA_DIR / "gsm8k_train.jsonl"
CODE_ALPACA = DATA_DIR / "code_alpaca_2k.json"
GSM8K_FORMAT = PromptResponseFormat(prompt="Question: {question}\nAnswer:", response=" {answer}")
MAX_SEQ_LEN = 1024


def load_real_data(base: BaseModel, data_dir: Path = DATA_DIR) -> tuple[list[Example], list[Example]] | None:
    gsm_path, code_path = data_dir / GSM8K.name, data_dir / CODE_ALPACA.name
    if not (gsm_path.is_file() and code_path.is_file()):
        return None
    started = time.perf_counter()
    gsm = load_examples(gsm_path, GSM8K_FORMAT, base.tokenizer, max_seq_len=MAX_SEQ_LEN).examples
    code = load_examples(code_path, AlpacaFormat(), base.tokenizer, max_seq_len=MAX_SEQ_LEN).examples
    log(f"data: {len(gsm)} GSM8K + {len(code)} Code Alpaca examples tokenized in {time.perf_counter() - started:.1f}s")
    return gsm, code


def minpad_padding_share(gsm: list[Example], code: list[Example], steps: int, rows: int) -> float:
    """mLoRA's padded_fused layout with MinPad choosing which jobs share each step: 2 GSM8K and 2 Code
    Alpaca jobs, each training `steps` micro-batches of `rows`; the padding share over all steps."""
    from policies.base import NextBatch
    from policies.minpad import MinPadPolicy

    def cost(chosen: list[NextBatch]) -> int:
        return max(max(b.lengths) for b in chosen) * sum(len(b.lengths) for b in chosen)

    cursors = {f"gsm8k-{i}": DataCursor(gsm, rows, seed=10 + i) for i in range(2)}
    cursors |= {f"code-{i}": DataCursor(code, rows, seed=20 + i) for i in range(2)}
    left = dict.fromkeys(cursors, steps)
    pending = {name: cursor.next_batch() for name, cursor in cursors.items()}
    waited = dict.fromkeys(cursors, 0)
    policy, processed, real = MinPadPolicy(), 0, 0
    while any(left.values()):
        batches = [NextBatch(name, tuple(len(e) for e in pending[name]),
                             waited[name]) for name in cursors if left[name]]
        chosen = policy.compose_step(batches, cost, 10**9, lambda chosen: True)
        processed += cost([b for b in batches if b.job in chosen])
        for name in cursors:
            waited[name] = 0 if name in chosen else waited[name] + 1
        for name in chosen:
            real += sum(len(e) for e in pending[name])
            left[name] -= 1
            pending[name] = cursors[name].next_batch()
    return (processed - real) / processed


def bench_padding(gsm: list[Example], code: list[Example], pad_id: int, steps: int, rows: int) -> dict:
    cursors = {"gsm8k": DataCursor(gsm, rows, seed=0), "code_alpaca": DataCursor(code, rows, seed=1)}
    layouts = ("packed", "padded", "padded_fused")
    processed = dict.fromkeys(layouts, 0)
    padding = dict.fromkeys(layouts, 0)
    real = 0
    for _ in range(steps):
        micro = [JobMicroBatch(name, cursor.next_batch()) for name, cursor in cursors.items()]
        real += sum(mb.num_tokens for mb in micro)
        for layout in layouts:
            batch = pack(micro, layout, pad_id)
            processed[layout] += batch.num_tokens
            padding[layout] += batch.padding_tokens
    share = {layout: padding[layout] / processed[layout] for layout in layouts}
    share["padded_fused + minpad"] = minpad_padding_share(gsm, code, steps, rows)
    log(f"(b) padding: {steps} fused steps of gsm8k + code_alpaca, {rows} rows per job, "
        f"{real} real tokens: " + ", ".join(f"{k} {fmt_pct(v)}" for k, v in share.items()))
    return {"steps": steps, "rows_per_job": rows, "real_tokens": real,
            "processed_tokens": processed, "padding_tokens": padding, "padding_share": share}
