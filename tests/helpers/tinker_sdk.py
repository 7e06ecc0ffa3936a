"""For tests that drive aspen's Tinker API with the real `tinker` SDK: the API served in this process over one
base's interactive calls (as docs/tinker.md shows it without a service), and supervised datums in the SDK's own
types."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from actors.engine.models import BaseModel
from actors.service.trainer.interactive_calls import InteractiveCalls
from orchestrator.tinker.tinker_routes import TinkerBackend, tinker_router
from tests.helpers.http_server import running_server


@contextmanager
def tinker_in_process(base: BaseModel, name: str, weights_dir: Path, authenticate: Callable[[str], str | None], *,
                      window_s: float) -> Iterator[tuple[str, TinkerBackend, list[dict]]]:
    """The API on `base` (named `name`) under uvicorn: (its URL, the backend, each fused pass's summary)."""
    from fastapi import FastAPI

    steps: list[dict] = []
    calls = InteractiveCalls(base, window_s=window_s, on_step=steps.append)
    backend = TinkerBackend(calls, name, weights_dir, authenticate).start()
    app = FastAPI()
    app.include_router(tinker_router(backend))
    try:
        with running_server(app) as url:
            yield url, backend, steps
    finally:
        backend.close()


@contextmanager
def tiny_api(tmp_path: Path, keys: dict[str, str], *,
             window_s: float) -> Iterator[tuple[str, TinkerBackend, list[dict]]]:
    """The API on a tiny random Llama named 'tiny-llama' (tests.helpers.models), its users' tokens `keys`."""
    from actors.engine.models import from_module
    from tests.helpers.models import VOCAB, tiny_model

    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), "tiny-llama", tmp_path / "weights",
                           keys.get, window_s=window_s) as served:
        yield served


def datums(rows: list[tuple[list[int], list[int], list[float]]]) -> list:
    """`cross_entropy` datums, one per (tokens, target tokens, weights) row."""
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64),
                                        "weights": np.array(weights, dtype=np.float32)})
            for tokens, targets, weights in rows]
