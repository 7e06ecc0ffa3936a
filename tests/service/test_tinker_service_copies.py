"""copy_weights over a running service (`aspen http`'s app over the service, as tests/service/test_tinker_service.py
serves it): the copy of a model's saved sampler weights is hard-linked into the service's Tinker folder (`du` counts
its weights once) and samples, after its source is saved again and then deleted, what the source sampled when
copied. The reference: the source's own greedy samples."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]
from tinker import types  # noqa: E402

from actors.service.scheduler.interactive_jobs import model_folder  # noqa: E402
from tests.helpers.tinker_sdk import datums  # noqa: E402
from tests.service.test_tinker_service import ADAM, batch, served  # noqa: E402,F401 (the module's fixture)

PROMPT = [5, 17, 3, 99, 42]


def greedy(client, path: str) -> list[int]:
    sampled = client.create_sampling_client(model_path=path).sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    return sampled.sequences[0].tokens


def test_a_copy_on_the_service_links_its_files_and_outlives_its_source(served):  # noqa: F811
    alice = tinker.ServiceClient(base_url=served["url"], api_key=f"tml-{served['alice']}", project_id="p")
    training = alice.create_lora_training_client(base_model=served["base"], rank=4).result()
    training.forward_backward(datums(batch(41)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    path = training.save_weights_for_sampler("w").result().path
    expected = greedy(alice, path)
    copied = alice.copy_weights(path).result()

    run = copied.removeprefix("tinker://").split("/")[0]
    folders = [model_folder(Path(served["state"]) / "tinker", run_id) / "sampler_weights" / "w"
               for run_id in (training.model_id, run)]
    out = subprocess.run(["du", "-sb", "--", *map(str, folders)], check=True, capture_output=True, text=True).stdout
    source_size, copy_extra = (int(line.split()[0]) for line in out.splitlines())
    weights = (folders[0] / "adapter_model.safetensors").stat().st_size
    assert copy_extra < source_size - weights + 4096, (source_size, copy_extra, weights)

    for seed in (42, 43):
        training.forward_backward(datums(batch(seed)), "cross_entropy").result()
        training.optim_step(types.AdamParams(**ADAM)).result()
    assert training.save_weights_for_sampler("w").result().path == path   # saved again under its name
    alice.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert greedy(alice, copied) == expected
    alice.close("success").result()
