"""A plug-in policy that cannot be loaded says which: its entry point (and the package that declares it) whose module
does not import or has no such class, or its class whose constructor raises. Before, `aspen run` printed only the
plug-in's own error ("aspen: ModuleNotFoundError: No module named 'x'"), naming neither the policy, the entry point
nor the package. Installed here as pip installs a package: a dist-info folder with its entry points on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from policies.registry import load_policy
from tests.helpers.service import write_task_data

PLUGIN = '''
class NeedsConfig:
    name = "needs-config"

    def __init__(self):
        raise RuntimeError("set MYPOL_CONFIG")

    def decide(self, snapshot):
        return []
'''
ENTRY_POINTS = """[aspen.policies]
needs-config = mypol:NeedsConfig
broken-import = mypol_missing:Thing
missing-class = mypol:NoSuchClass
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "site"
    (folder / "mypol").mkdir(parents=True)
    (folder / "mypol" / "__init__.py").write_text(PLUGIN)
    (folder / "mypol-0.1.dist-info").mkdir()
    (folder / "mypol-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mypol\nVersion: 0.1\n")
    (folder / "mypol-0.1.dist-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.mark.parametrize(("name", "says"), [
    ("broken-import", "its entry point (aspen.policies) 'broken-import = mypol_missing:Thing' of the package mypol 0.1 "
                      "cannot be loaded: ModuleNotFoundError(\"No module named 'mypol_missing'\"); reinstall or fix "
                      "that package"),
    ("missing-class", "'missing-class = mypol:NoSuchClass' of the package mypol 0.1 cannot be loaded: AttributeError("),
    ("needs-config", "mypol.NeedsConfig() raised RuntimeError('set MYPOL_CONFIG'); fix it (or its settings)"),
    ("mypol:NeedsConfig", "mypol.NeedsConfig() raised RuntimeError('set MYPOL_CONFIG')"),
])
def test_a_policy_that_cannot_be_loaded_names_itself_and_what_is_installed(plugin, name, says):
    with pytest.raises(ValueError) as raised:
        load_policy(name)
    message = str(raised.value)
    assert message.startswith(f"policy '{name}': ") and says in message, message
    assert "built-in policies are adaptive, fifo, minpad, priority, sjf; installed entry points (aspen.policies): " \
           "broken-import, " in message and "needs-config" in message, message


def test_aspen_run_names_the_plugin_whose_entry_point_does_not_import(plugin, tmp_path, tiny_model_dirs):
    """The real CLI in a subprocess (`aspen run --in-process`, a jobs file naming the policy)."""
    data = write_task_data(tmp_path / "data", "t", rows=8)
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"base_model: {tiny_model_dirs['llama']}\noutput_dir: {tmp_path / 'out'}\npolicy: broken-import\n"
                    f"jobs:\n  - {{name: a, data: {data}, max_steps: 1, batch_size: 4, max_seq_len: 64, format: "
                    "{type: prompt_response, prompt: 'Q: {question}', response: ' {answer}'}}\n")
    path = os.pathsep.join([str(Path.cwd()), str(plugin)])
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(jobs), "--in-process"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert run.returncode != 0, run.stdout
    assert ("aspen: policy 'broken-import': its entry point (aspen.policies) 'broken-import = mypol_missing:Thing' of "
            "the package mypol 0.1 cannot be loaded") in run.stderr, run.stderr


def test_aspen_run_in_process_says_the_policy_cannot_be_loaded_before_loading_its_base_model(plugin, tmp_path,
                                                                                             tiny_model_dirs,
                                                                                             monkeypatch):
    """It loaded the base model first (minutes for a large one), then met the policy's error."""
    from actors.service.scheduler import local_run
    from tests.helpers.service import job_dict, run_spec

    loaded = []
    monkeypatch.setattr(local_run, "load_base_model", lambda *args, **kwargs: loaded.append(args))
    data = write_task_data(tmp_path / "data", "t", rows=8)
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, 1)])
    with pytest.raises(ValueError, match="policy 'broken-import': its entry point"):
        local_run.train_locally(spec.model_copy(update={"policy": "broken-import"}), progress=False)
    assert loaded == []
