"""SmolLM2's tokenizer cut to its first tokens, for the tiny test models: a byte-level BPE keeps every text
tokenizable with any prefix of its vocabulary (its first 17 ids are the special tokens, the next 256 the
bytes, then one token per merge in merge order), so keeping the first `size` ids and the merges that make them
gives a tokenizer with the same special tokens and chat template whose ids stay below `size`. A tiny model's
LM head and loss, most of its step at SmolLM2's 49,152 tokens (hidden size 64), shrink with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


def cut_tokenizer(source: Path, out: Path, size: int) -> Path:
    """A copy of the saved tokenizer folder `source` in `out`, its BPE vocabulary cut to ids below `size`."""
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name != TOKENIZER_FILE:
            shutil.copy(path, out / path.name)
    saved = json.loads((source / TOKENIZER_FILE).read_text())
    model = saved["model"]
    if model["type"] != "BPE" or saved["pre_tokenizer"]["type"] != "ByteLevel":
        raise ValueError(f"{source}: not a byte-level BPE tokenizer; cutting its vocabulary could lose texts")
    if any(token["id"] >= size for token in saved["added_tokens"]):
        raise ValueError(f"{source}: a special token has an id of {size} or more")
    vocab = {token: index for token, index in model["vocab"].items() if index < size}
    model["vocab"] = vocab
    model["merges"] = [pair for pair in model["merges"]
                       if pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab]
    (out / TOKENIZER_FILE).write_text(json.dumps(saved))
    return out
