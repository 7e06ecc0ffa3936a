"""The base models' tokenizers the HTTP server checks submissions' rows with (orchestrator/http/data_rows.py): each
loaded once in this process (about a second each; the server loaded one at every submission) and kept for the
`KEPT` bases used last. A fast (Rust) tokenizer used from two threads at once can raise "Already borrowed", and the
row checks run in threads: each tokenizer is used under its own lock (`held`), which is also the one its loading
holds, so that submissions arriving together on a new base load it once. A base whose tokenizer cannot be loaded
here is not kept: the next submission tries again. Ray-free; imports the tokenizer's code on first use."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

KEPT = 4   # bases whose tokenizers are kept (a few hundred MB at most; most servers serve one or two bases)


class TokenizerUnavailable(Exception):
    """A base's tokenizer cannot be loaded here (`load_base_tokenizer`'s OSError or ValueError, its cause)."""


@dataclass
class _Kept:
    lock: threading.Lock = field(default_factory=threading.Lock)   # held while it loads, and while it is used
    tokenizer: Any = None


class BaseTokenizers:
    """Tokenizers by base model, loaded with `load` (`load_base_tokenizer` by default), at most `kept` of them."""

    def __init__(self, load: Callable[[str], Any] | None = None, kept: int = KEPT):
        self.load = load
        self.kept = kept
        self._lock = threading.Lock()   # the table of kept tokenizers (not their use)
        self._by_base: OrderedDict[str, _Kept] = OrderedDict()

    @contextmanager
    def held(self, base: str) -> Iterator[Any]:
        """`base`'s tokenizer, used by this thread alone meanwhile; loaded on first use (TokenizerUnavailable where it
        cannot be: not on this machine, say)."""
        with self._lock:
            kept = self._by_base.get(base)
            if kept is None:
                kept = self._by_base[base] = _Kept()
                while len(self._by_base) > self.kept:   # the least recently used goes (a thread using it keeps it)
                    self._by_base.popitem(last=False)
            self._by_base.move_to_end(base)
        with kept.lock:
            if kept.tokenizer is None:
                try:
                    kept.tokenizer = self._loader()(base)
                except BaseException as error:
                    with self._lock:   # not kept: the next submission tries again
                        if self._by_base.get(base) is kept:
                            del self._by_base[base]
                    if isinstance(error, (OSError, ValueError)):
                        raise TokenizerUnavailable(f"{base}: {error}") from error
                    raise
            yield kept.tokenizer

    def _loader(self) -> Callable[[str], Any]:
        if self.load is not None:
            return self.load
        from actors.storage.sources import load_base_tokenizer

        return load_base_tokenizer


TOKENIZERS = BaseTokenizers()
"""This process's tokenizers (the HTTP server's row checks)."""
