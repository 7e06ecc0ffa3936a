#!/usr/bin/env python
"""A model folder with random weights of another folder's architecture, keeping its tokenizer: a base for speed
measurements where the real weights cannot travel (a leased GPU machine takes 64 MiB a call; smollm2-135m's
converted weights are 517 MB). Throughput does not depend on the weights' values.

    python bench/random_weights.py [--tiny] SHAPE_DIR OUT_DIR      # SHAPE_DIR: config.json and the tokenizer's files

--tiny: the same family with 2 layers of width 64 (a dry run of what trains on it).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "special_tokens_map.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tiny", action="store_true", help="2 layers of width 64, the vocabulary kept")
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(args.shape_dir)
    if args.tiny:
        config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16})
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    for name in KEEP:
        if (args.shape_dir / name).exists() and name != "config.json":
            shutil.copy(args.shape_dir / name, args.out_dir / name)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{args.out_dir}: {parameters:,} random parameters of {args.shape_dir}'s architecture")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
