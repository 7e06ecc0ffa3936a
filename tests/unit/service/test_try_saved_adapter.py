""""Try it" on the adapter a finished job saved: on a trainer loop between two steps of another job, the prompt
continued as PEFT's greedy `generate` continues it through that folder (and as transformers' through the base
alone); the adapter is on the base for the call only, so the job training meanwhile ends bit for bit as alone; a
folder that cannot be read fails the call alone, saying which file, and leaves nothing on the base."""

from __future__ import annotations

import shutil

import pytest
import torch

from actors.engine.adapter_surgery import fused_layers
from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.job_spec import JobSpec
from actors.spec.saved_adapter import WEIGHTS_NAME
from tests.helpers.peft_adapters import saved_peft_lora
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle

PROMPT = "Q: what is 3 and 9?\nA:"
NEW_TOKENS = 8
TARGETS = ["q_proj", "v_proj", "down_proj"]


def reference_text(model_dir, adapter, tokenizer, stops) -> str:
    """PEFT's (or, without `adapter`, transformers') greedy continuation of PROMPT, cut at the first stop token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([tokenizer(PROMPT, add_special_tokens=True)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0])
    new = out[0, ids.shape[1]:].tolist()
    for index, token in enumerate(new):
        if token in stops:
            new = new[:index]
            break
    return tokenizer.decode(new, skip_special_tokens=True)


def test_a_saved_adapter_is_tried_between_steps_as_peft_continues_it(tmp_path, tiny_base, tiny_model_dirs):
    from actors.engine.generation_eval import stop_token_ids

    model_dir = str(tiny_model_dirs["llama"])
    saved = saved_peft_lora(model_dir, tmp_path / "saved", TARGETS, seed=5, scale=0.5)
    job_spec = JobSpec.model_validate(job_dict("finished", tmp_path / "unused.jsonl", 1,
                                               lora={"r": 4, "alpha": 8, "target_modules": TARGETS}))
    data = write_task_data(tmp_path / "data", "busy")
    busy = job_dict("busy", data, 4, lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": TARGETS})
    (alone,) = run_spec(model_dir, tmp_path / "alone", [busy]).submissions()
    (beside,) = run_spec(model_dir, tmp_path / "beside", [busy]).submissions()
    config = TrainerConfig(base_model=model_dir)
    solo = TrainerLoop(tiny_base, config, "trainer-s", tmp_path / "solo-state")
    solo.assign(assignment_for(alone, "busy-1", tiny_base.tokenizer))
    assert any(e.kind == "completed" for e in run_until_idle(solo))

    loop = TrainerLoop(tiny_base, config, "trainer-t", tmp_path / "state")
    loop.assign(assignment_for(beside, "busy-1", tiny_base.tokenizer))
    for _ in range(2):
        loop.run_once(idle_wait=0)
    answer = loop.try_saved("finished-1", job_spec, str(saved), 7, PROMPT, NEW_TOKENS)
    stops = stop_token_ids(tiny_base)
    assert answer["adapter"] == reference_text(model_dir, saved, tiny_base.tokenizer, stops)
    assert answer["base"] == reference_text(model_dir, None, tiny_base.tokenizer, stops)
    assert answer["adapter"] != answer["base"], "the adapter changed nothing: the check would not see it missing"
    assert (answer["job"], answer["step"]) == ("finished-1", 7)
    attached = {name for layer in fused_layers(tiny_base.model) for name in layer.adapters}
    assert attached == {"busy-1"}   # the tried adapter was on the base for the call only

    cut = tmp_path / "cut"
    shutil.copytree(saved, cut)
    (cut / WEIGHTS_NAME).write_bytes((saved / WEIGHTS_NAME).read_bytes()[:64])
    with pytest.raises(ValueError, match=rf"job finished-1's adapter cannot be tried: {cut / WEIGHTS_NAME} is not a "
                                         "safetensors file"):
        loop.try_saved("finished-1", job_spec, str(cut), 7, PROMPT, NEW_TOKENS)
    with pytest.raises(ValueError, match="the prompt is empty"):
        loop.try_saved("finished-1", job_spec, str(saved), 7, "  ", NEW_TOKENS)
    assert {name for layer in fused_layers(tiny_base.model) for name in layer.adapters} == {"busy-1"}

    assert any(e.kind == "completed" for e in run_until_idle(loop))
    end, reference = adapter_tensors(tmp_path / "beside" / "busy"), adapter_tensors(tmp_path / "alone" / "busy")
    assert all(torch.equal(end[key], reference[key]) for key in reference), "the try changed the busy job's training"


@pytest.mark.parametrize("lora", [{"use_dora": True}, {"init_lora_weights": "pissa"}, {"init_lora_weights": "olora"}],
                         ids=["dora", "pissa", "olora"])
def test_a_finished_jobs_folder_is_tried_as_peft_reads_it(tmp_path, tiny_base, tiny_model_dirs, lora):
    """A finished aspen job's own folder, of an adapter that is not a plain LoRA (DoRA's magnitudes; PiSSA and OLoRA
    saved as PEFT's conversion to a plain LoRA of twice the rank on the untouched base): tried, its continuation is
    PEFT's greedy one through that folder."""
    from actors.engine.generation_eval import stop_token_ids
    from actors.service.scheduler.local_run import train_locally

    model_dir = str(tiny_model_dirs["llama"])
    finished = job_dict("finished", write_task_data(tmp_path / "data", "finished"), 4, lr=0.05,
                        lora={"r": 4, "alpha": 8, "target_modules": TARGETS, **lora})
    train_locally(run_spec(model_dir, tmp_path / "done", [finished]), progress=False)
    folder = tmp_path / "done" / "finished"
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=model_dir), "trainer-t", tmp_path / "state")
    try:
        answer = loop.try_saved("finished", JobSpec.model_validate(finished), str(folder), 4, PROMPT, NEW_TOKENS)
    finally:
        loop.close()
    stops = stop_token_ids(tiny_base)
    assert answer["adapter"] == reference_text(model_dir, folder, tiny_base.tokenizer, stops)
    assert answer["adapter"] != answer["base"], "the adapter changed nothing: the check would not see it missing"
    assert not [name for layer in fused_layers(tiny_base.model) for name in layer.adapters]
