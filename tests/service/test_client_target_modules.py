"""The Python client over Ray checks a job's `lora.target_modules` against its base before it asks the service, as
`aspen submit` and the HTTP API do (orchestrator/base_check.py). The service checks the names only against a trainer
of the base that has reported its layers: before one has (a GPU trainer waiting for its node, a large base still
loading), `Client.submit_many` / `submit_run` entered a job naming a layer the base does not have, which then failed
once a trainer came. Now the client raises `SpecError` naming the job, the field and entry, the name, the nearest
one and the base's layer names, and nothing is entered.
The reference: the base's own linear layers, read from its safetensors file with safetensors (not aspen's code), and
the service's job list (empty). The real client, on a service on the local Ray."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from orchestrator.client import Client
from orchestrator.jobs_file import SpecError
from tests.helpers.service import job_dict, run_spec, service_config, write_task_data


def linear_short_names(folder) -> list[str]:
    """The last name component of every 2-D `.weight` of the base's layers (its linear layers), embeddings aside."""
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = [n for n in weights.keys() if n.endswith(".weight") and ".layers." in n
                 and len(weights.get_slice(n).get_shape()) == 2]
    return sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n in names})


@pytest.mark.long   # a service on the local Ray: 20-40 s here
def test_the_ray_client_refuses_a_target_module_the_base_lacks_naming_field_nearest_and_layers(
        ray_session, tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["llama"]
    layers = linear_short_names(folder)
    assert "v_proj" in layers and "v_prj" not in layers   # the reference: the typo is no layer of the base
    data = write_task_data(tmp_path / "data", "t")
    good = job_dict("good", data, 2)
    typo = job_dict("typo", data, 2, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_prj"]})
    # its trainer wants a GPU, which this machine has not: it waits for a GPU node, reporting no layers meanwhile
    client = Client.local(service_config(tmp_path / "state", folder, num_gpus=1), wait_ready=False)
    try:
        with pytest.raises(SpecError) as many:
            client.submit_many([good, typo], base_model=str(folder))
        with pytest.raises(SpecError) as run:
            client.submit_run(run_spec(str(folder), tmp_path / "run", [good, typo]))
        entered = client.jobs()
    finally:
        client.shutdown()
    assert entered == []   # nothing entered, the good job neither (all or none)
    for refused in (many, run):
        text = str(refused.value)
        assert text.startswith("nothing was submitted:\njob 'typo' (2 of 2), field lora.target_modules.1 (base "
                               f"{folder}): 'v_prj' matches no linear layer of the base model; did you mean "
                               "'v_proj'? its linear layers are named "), text
        assert f"its linear layers are named {', '.join(layers)} (or use 'all-linear')" in text, text
        assert text.endswith(f"(fix the names for base {folder}, then submit again)"), text
