#!/usr/bin/env python
"""A random model with SmolLM2-135M's architecture and tokenizer but narrow (its 30 layers, hidden size 64),
saved as a Hugging Face folder. Its fused steps (~0.4 s on 2 CPU cores with one torch thread) are bound by
per-operation overhead rather than arithmetic, as a small model's steps are on a GPU, so CPU runs of the
benchmarks show costs that otherwise only a GPU shows: the first steps of a fresh process, garbage
collection pauses, what happens between steps.

    .venv/bin/python bench/deep_tiny_model.py OUT_DIR
    .venv/bin/python bench/overhead.py --base-model OUT_DIR --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.storage.sources import load_tokenizer, resolve_source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    source = resolve_source("smollm2-135m")
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    config.hidden_size, config.intermediate_size = 64, 128
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out_dir)
    load_tokenizer(source).save_pretrained(args.out_dir)
    print(f"{args.out_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{config.num_hidden_layers} layers of width {config.hidden_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
