"""Which of a base's linear layers belong to its attention, its MLP or its LM head, by module name: the Tinker API's
`train_attn`, `train_mlp` and `train_unembed`, decided the same way on the scheduler (torch-free) and the trainer.

Attention is a layer's token mixer: attention proper under any of the names transformers gives it (`self_attn`,
`attn`, GPT-NeoX's `attention`, Falcon's `self_attention`), and what stands in for it in hybrid models (Qwen3.5's
`linear_attn`, LFM2's short convolutions `conv`); everything else of a decoder layer is the MLP."""

from __future__ import annotations

HEAD_MODULE = "lm_head"   # PEFT's module name for the output embedding (its target_modules entry)
ATTENTION_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")
MIXER_PARTS = ("conv",)   # a module-name part that is a token mixer though it names no attention


def is_attention(module: str) -> bool:
    """Whether a linear layer (by its module name) is attention's (`train_attn`) rather than the MLP's."""
    *parents, leaf = module.split(".")
    return leaf in ATTENTION_LEAVES or any("attn" in part or "attention" in part or part in MIXER_PARTS
                                           for part in parents)


def part_targets(linear_names: list[str], *, train_attn: bool, train_mlp: bool) -> list[str]:
    """PEFT `target_modules` naming exactly the decoder's linear layers of the parts asked for (never the LM head):
    each layer's leaf name, or its last two name parts where a layer of the other part has the same leaf (GPT-2's
    `attn.c_proj` beside `mlp.c_proj`), which PEFT matches as a suffix of the module name."""
    chosen, other = [], []
    for name in linear_names:
        if name.rsplit(".", 1)[-1] == HEAD_MODULE:
            continue
        attention = is_attention(name)
        (chosen if (attention and train_attn) or (not attention and train_mlp) else other).append(name)
    shared = {name.rsplit(".", 1)[-1] for name in other}
    return sorted({".".join(name.split(".")[-2:]) if name.rsplit(".", 1)[-1] in shared else name.rsplit(".", 1)[-1]
                   for name in chosen})
