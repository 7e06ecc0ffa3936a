"""Base-model loading: HF folders, the embedded GGUF alias, hub ids (cache only), bitsandbytes quantization."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.engine.job import TrainingJob
from actors.engine.models import load_base_model, resolve_source
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.storage.sources import load_base_tokenizer, tokenizer_cache_folder, tokenizer_cache_lock
from tests.helpers.hub import REVISION, offline
from tests.helpers.models import random_examples


def test_hf_folder_loads_frozen_float32_on_cpu(tiny_model_dirs):
    base = load_base_model(str(tiny_model_dirs["qwen2"]), device="cpu")
    assert base.dtype == torch.float32 and base.device.type == "cpu"
    assert not any(p.requires_grad for p in base.model.parameters())
    assert base.model.config._attn_implementation == "aspen_varlen"
    assert base.tokenizer.eos_token == "<|im_end|>"


def test_uncached_hub_id_and_missing_paths_give_actionable_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="only when it is already in the local Hugging Face cache"):
        load_base_model("someone/not-a-cached-model", device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_a_hub_id_loads_from_the_local_cache_and_an_uncached_one_says_how_to_get_it(monkeypatch, tmp_path,
                                                                                    tiny_model_dirs):
    """A hub id in the local Hugging Face cache (laid out as the hub's client writes it) loads, tokenizer alone
    too, as the same model as its folder; one not in the cache is refused by the tokenizer's read (what `aspen
    run` and a job actor read first) as by the model's, naming the cache and `hf download`, not with
    transformers' "couldn't connect to huggingface.co" (nothing is asked of the network). The embedded base's
    own hub id says which alias trains on its GGUF copy."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--aspen-tests--tiny-llama" / "snapshots" / REVISION
    snapshot.parent.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(REVISION)
    shutil.copytree(tiny_model_dirs["llama"], snapshot)
    offline(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    base = load_base_model("aspen-tests/tiny-llama", dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(base.model.state_dict()[name], tensor), name
    assert load_base_tokenizer("aspen-tests/tiny-llama").encode("a b c") == base.tokenizer.encode("a b c")

    for load in (load_base_tokenizer, lambda model: load_base_model(model, device="cpu")):
        with pytest.raises(FileNotFoundError) as refused:
            load("aspen-tests/not-cached")
        message = str(refused.value)
        assert "'aspen-tests/not-cached' is not in the local Hugging Face cache" in message, message
        assert str(cache) in message and "`hf download aspen-tests/not-cached`" in message, message
        assert "huggingface.co" not in message, message
    with pytest.raises(FileNotFoundError, match="`base_model: smollm2-135m` trains on it"):
        load_base_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("quantization, weight_dtypes", [("int8", {torch.int8}), ("nf4", {torch.uint8})])
def test_quantized_base_trains_on_cpu(tiny_model_dirs, quantization, weight_dtypes):
    folder = tiny_model_dirs["llama"]
    base = load_base_model(str(folder), device="cpu", quantization=quantization)
    q_proj = base.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype in weight_dtypes
    # the quantized model stays close to the float one (reference: the float model's logits)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([random_examples(0, count=1, min_len=16, max_len=16)[0].input_ids])
    with torch.no_grad():
        float_logits = reference(input_ids=ids).logits
        quant_logits = base.model(input_ids=ids, use_cache=False).logits
    assert torch.nn.functional.cosine_similarity(float_logits.flatten(), quant_logits.flatten(), dim=0) > 0.95

    examples = random_examples(1, count=4)
    spec = JobSpec(name="q", data="x", format={"type": "text"}, max_steps=12, lr=2e-2, batch_size=4,
                   lora={"r": 4, "target_modules": "all-linear"})
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, examples, examples, seed=0)
    trainer.add_job(job)
    before = trainer.evaluate(job)
    while trainer.train_step() is not None:
        pass
    assert trainer.evaluate(job) < before - 0.1


def test_job_actors_starting_together_build_the_tokenizer_cache_once(tmp_path, smol_tokenizer):
    """While one process builds the GGUF tokenizer's cache, another waits for it and then loads it from
    the cache instead of rebuilding it. Shown with a marker token that only the cached copy has."""
    source = resolve_source("smollm2-135m")
    folder = tokenizer_cache_folder(source, tmp_path)
    folder.parent.mkdir(parents=True)
    lock_path = tokenizer_cache_lock(folder)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # "another job actor is building it"
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; from actors.storage.sources import load_base_tokenizer; "
             "t = load_base_tokenizer('smollm2-135m', sys.argv[1]); print(len(t), '<|marker|>' in t.get_vocab())",
             str(tmp_path)], cwd=Path(__file__).resolve().parents[3], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "ASPEN_CACHE_DIR": "off"})   # not a converted model folder (gguf_cache.py)
        inode = os.stat(lock_path).st_ino
        deadline = time.time() + 120
        while not any("->" in line and f":{inode} " in line for line in Path("/proc/locks").read_text().splitlines()):
            assert child.poll() is None, "the second process did not wait for the first one's cache"
            assert time.time() < deadline, "the second process never asked for the cache lock"
            time.sleep(0.05)
        marked = copy.deepcopy(smol_tokenizer)
        marked.add_special_tokens({"additional_special_tokens": ["<|marker|>"]})
        marked.save_pretrained(folder)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert out.split() == [str(len(smol_tokenizer) + 1), "True"]


def test_a_generic_tokenizer_folder_loads_as_autotokenizer_loads_it_and_without_torch(tmp_path, tiny_model_dirs):
    """A folder whose tokenizer class is transformers' generic one (every GGUF tokenizer aspen caches) is
    loaded through that class directly: the same class, vocabulary, special tokens, token ids and chat
    template rendering as AutoTokenizer's, and in a fresh process no torch imported. A folder naming a
    model-specific class still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    from actors.storage.sources import GENERIC_TOKENIZER, load_base_tokenizer

    folder = tiny_model_dirs["llama"]
    ours, reference = load_base_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(reference) and type(ours).__name__ == GENERIC_TOKENIZER
    assert ours.get_vocab() == reference.get_vocab() and ours.all_special_tokens == reference.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.eos_token_id)   # pad: eos where there is none
    texts = ["Q: 12+30\nA: 42", "<|im_start|>user\nhé, ça va?<|im_end|>", "  spaces\tand\ttabs  ", ""]
    assert [ours(t)["input_ids"] for t in texts] == [reference(t)["input_ids"] for t in texts]
    chat = [{"role": "user", "content": "Say 3"}, {"role": "assistant", "content": "3"}]
    assert ours.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(chat, tokenize=False)

    loaded = subprocess.run([sys.executable, "-c",
                             "import sys; from actors.storage.sources import load_base_tokenizer; "
                             "t = load_base_tokenizer(sys.argv[1]); print(len(t), 'torch' in sys.modules)",
                             str(folder)], cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True,
                            timeout=120, check=True).stdout.split()
    assert loaded == [str(len(reference)), "False"]

    specific = tmp_path / "specific"   # the same files, naming a model-specific class: AutoTokenizer's way
    reference.save_pretrained(specific)
    (specific / "config.json").write_text((folder / "config.json").read_text())
    config = json.loads((specific / "tokenizer_config.json").read_text())
    (specific / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_base_tokenizer(str(specific))) is type(AutoTokenizer.from_pretrained(specific))
    assert type(AutoTokenizer.from_pretrained(specific)).__name__ != GENERIC_TOKENIZER
