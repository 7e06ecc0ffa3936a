"""Notices of the libraries aspen drives that are not its users' business, silenced each at its source (one
logger's one message, one call's one warning), never by a blanket filter:

- bitsandbytes, when imported (by PEFT or aspen's quantization) on a machine without the `kernels` package,
  logs that it could not load the kernels-community CPU 4-bit matrix product and asks for `pip install
  kernels`: that package downloads its kernels from the Hugging Face hub when used, which aspen never does
  at run time; bitsandbytes' own CPU implementation runs instead (aspen's NF4 tests run on it).
- PEFT's `PeftModel` reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning from
  transformers 5 on every `PeftModel.from_pretrained`); `peft_calls()` silences that one warning around the
  PEFT calls aspen makes (the merge of `aspen export --merge`)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

BNB_CPU_KERNELS_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_CPU_KERNELS_NOTICE = "from kernels-community"
PEFT_GRADIENT_CHECKPOINTING = r"`is_gradient_checkpointing` is deprecated"


class _WithoutMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def install() -> None:
    """Silence bitsandbytes' notice about the `kernels` package (once per process; its other messages stay)."""
    logger = logging.getLogger(BNB_CPU_KERNELS_LOGGER)
    if not any(isinstance(f, _WithoutMessage) for f in logger.filters):
        logger.addFilter(_WithoutMessage(BNB_CPU_KERNELS_NOTICE))


@contextlib.contextmanager
def peft_calls() -> Iterator[None]:
    """Around a PEFT call: transformers' FutureWarning about `is_gradient_checkpointing`, which PEFT reads,
    is not shown (every other warning is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_GRADIENT_CHECKPOINTING, category=FutureWarning)
        yield
