"""Real Ray nodes for tests, started as users start them: `ray start --head` (after `ray get-auth-token
--generate` where token authentication is wanted) and `ray start --address` for a second node on the same
machine, each with its own temp dir and ports. A node is stopped by its process session (SIGKILL of
every process in it), never `ray stop` (it would stop every Ray on the machine); `kill_node` loses a
node the hard way (SIGKILL of its raylet and workers at once), as a machine that dies does."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.ports import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]

# The head notices a lost node within about 3 s instead of Ray's default 30 s or so (health checks every
# second, 3 missed): what a test of node loss waits for, not what it tests.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


def plain_env(home: Path) -> dict[str, str]:
    """This environment without Ray's variables, with `home` as HOME: no ~/.ray/auth_token of the test
    session's own Ray (or the developer's) is found by accident."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(home)
    return env


def session_pids(session: int) -> list[int]:
    """The processes of a process session (Linux /proc; elsewhere none): Ray's workers run in process
    groups of their own but stay in the session of the `ray start` that started their node."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:
            pids.append(int(stat.parent.name))
    return pids


def kill_node(node: dict) -> None:
    """SIGKILL to every process of the node at once (its raylet, object store, agents and workers); its folders
    removed (a killed node is not stopped again)."""
    kill_session(node["process"])
    _remove_folders(node)


def kill_session(process: subprocess.Popen, rounds: int = 1) -> None:
    """SIGKILL to every process of the session `process` leads (a Ray node's raylet, GCS and workers: never
    `ray stop`), `rounds` times (a worker forked meanwhile is caught by the next), then reap it."""
    for _ in range(rounds):
        for pid in session_pids(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    process.wait(timeout=30)


def stop_head(head: dict) -> None:
    """SIGKILL to every process of the node's session; its temp dir (and HOME, for a head) removed. Not a
    SIGTERM first: `ray start --block` answers one by draining the node for up to 30 s
    (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) before it stops anything, so a grace period of a few seconds
    only ever ran out (measured: still running 40 s after the SIGTERM) and a test node has nothing to drain."""
    process: subprocess.Popen = head["process"]
    for _ in range(2):   # again: a process forked while the first sweep ran (a raylet starting a worker)
        for pid in session_pids(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)
    _remove_folders(head)


def _remove_folders(node: dict) -> None:
    """The node's temp dir and HOME, once its processes are gone (copied first where ASPEN_KEEP_RAY_LOGS names
    a folder for debugging)."""
    keep = os.environ.get("ASPEN_KEEP_RAY_LOGS")
    if keep:
        shutil.copytree(Path(node["temp_dir"]) / "session_latest" / "logs",
                        Path(keep) / Path(node["temp_dir"]).name, dirs_exist_ok=True)
    for folder in (node["temp_dir"], node.get("home")):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


stop_node = stop_head


def _node_ports() -> list[str]:
    # every port of its own: the defaults (52365, 10001, ...) may be held by the test session's own Ray or by
    # another node, and a head whose job agent cannot bind answers every submission with "No available agent"
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}"]


START_OUTPUT = "ray-start.out"   # in a node's temp dir


def _own_tmp(temp_dir: str) -> dict[str, str]:
    """TMPDIR for a node's processes: a folder in its temp dir, removed with it. A head's processes make
    temporary files of their own (multiprocessing's `pymp-*` folder with a listener socket), which a node
    stopped by SIGKILL never removes: they stayed in /tmp, one a head."""
    folder = Path(temp_dir) / "tmp"
    folder.mkdir()
    return {"TMPDIR": str(folder)}


def start_head(*, token: bool, num_cpus: int = 2, env: dict[str, str] | None = None) -> dict:
    """A head node as a fresh machine starts it: HOME an empty folder; with `token`, the README's
    `ray get-auth-token --generate` first (Ray then turns token authentication on), else Ray runs open.
    `env`: further environment of the node's processes (e.g. FAST_NODE_DEATH)."""
    home = Path(tempfile.mkdtemp(prefix="aspen-home-"))
    temp_dir = tempfile.mkdtemp(prefix="aspen-ray-")  # short: Ray's socket paths must stay short
    node_env = {**plain_env(home), **_own_tmp(temp_dir), **(env or {})}
    if token:
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=node_env, capture_output=True,
                       text=True, timeout=120, check=True)
    gcs, dashboard = free_port(), free_port()
    process = _ray_start(temp_dir, node_env, "--head", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
                         f"--num-cpus={num_cpus}", "--object-store-memory=200000000", f"--port={gcs}",
                         f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}")
    head = {"process": process, "temp_dir": temp_dir, "home": home, "dashboard": f"http://127.0.0.1:{dashboard}",
            "gcs": f"127.0.0.1:{gcs}", "token": (home / ".ray" / "auth_token").read_text().strip() if token else None}
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{head['dashboard']}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:   # 401 without a token: the server is up
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError(f"ray start --head did not come up (exit code {process.poll()}); "
                                       f"{_startup_report(temp_dir)}") from None
                time.sleep(1)
    except BaseException:
        stop_head(head)
        raise
    return head


def client_env(head: dict, home: Path) -> dict[str, str]:
    """The environment of a program that talks to the head (a client, `ray job submit`, a worker node)."""
    env = plain_env(home)
    if head.get("token"):
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=head["token"])
    return env


def start_worker(head: dict, *, num_cpus: int = 1, env: dict[str, str] | None = None) -> dict:
    """A second node on this machine joining `head` (`ray start --address`), with its own temp dir and
    ports; returns once the head counts it among its live nodes."""
    home = Path(tempfile.mkdtemp(prefix="aspen-home-"))
    temp_dir = tempfile.mkdtemp(prefix="aspen-ray-")
    node_env = {**client_env(head, home), **_own_tmp(temp_dir), **(env or {})}
    before = len(live_nodes(head, home))
    process = _ray_start(temp_dir, node_env, f"--address={head['gcs']}", f"--num-cpus={num_cpus}",
                         "--object-store-memory=100000000")
    worker = {"process": process, "temp_dir": temp_dir, "home": home}
    try:
        deadline = time.time() + 120
        while len(live_nodes(head, home)) <= before:
            if time.time() > deadline or process.poll() is not None:
                raise RuntimeError(f"ray start --address did not join (exit code {process.poll()}); "
                                   f"{_startup_report(temp_dir)}")
            time.sleep(1)
    except BaseException:
        stop_node(worker)
        raise
    return worker


def _ray_start(temp_dir: str, env: dict[str, str], *arguments: str) -> subprocess.Popen:
    """`ray start --block` with `arguments`, the node's temp dir and ports of its own, in a process session of
    its own (how the node is stopped); its output kept in the temp dir for `_startup_report`."""
    with (Path(temp_dir) / START_OUTPUT).open("wb") as sink:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", *arguments, f"--temp-dir={temp_dir}",
                                 *_node_ports()], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _startup_report(temp_dir: str) -> str:
    """What a node that did not come up left: the tail of `ray start`'s own output and of each of its
    processes' error logs that is not empty."""
    folder = Path(temp_dir)
    parts = [f"ray start printed:\n{(folder / START_OUTPUT).read_text(errors='replace')[-3000:]}"]
    for log in sorted((folder / "session_latest" / "logs").glob("*.err")):
        text = log.read_text(errors="replace").strip()
        if text:
            parts.append(f"{log.name}:\n{text[-1500:]}")
    return "\n".join(parts)


def live_nodes(head: dict, home: Path) -> list[dict]:
    """The head's live nodes as `ray.nodes()` lists them, asked from a separate process."""
    script = (f"import json, ray; ray.init(address='{head['gcs']}', log_to_driver=False); "
              "print('NODES', json.dumps([{'id': n['NodeID'], 'cpus': n['Resources'].get('CPU', 0)} "
              "for n in ray.nodes() if n['Alive']]), flush=True)")
    result = subprocess.run([sys.executable, "-c", script], env=client_env(head, home), capture_output=True,
                            text=True, timeout=120)
    # Ray's core may print its own log lines to stdout too (e.g. about a node that just died): the answer
    # is the line marked NODES
    answer = [line for line in result.stdout.splitlines() if line.startswith("NODES ")]
    if result.returncode != 0 or not answer:
        raise RuntimeError(f"cannot list the nodes of {head['gcs']} (exit code {result.returncode}): "
                           f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return json.loads(answer[-1].removeprefix("NODES "))


CLIENT_LOOP = """
import json, os, sys
answers = os.fdopen(int(sys.argv[2]), "w")   # a pipe of its own: Ray writes worker logs to stdout
from orchestrator.client import Client
c = Client.connect(sys.argv[1])
print("READY", file=answers, flush=True)
for line in sys.stdin:
    request = json.loads(line)
    names = {"c": c}
    try:
        exec(request["setup"], names)
        answer = {"value": eval(request["expression"], names)}
    except Exception as error:
        answer = {"error": repr(error)}
    print("RESULT " + json.dumps(answer, default=lambda o: getattr(o, "__dict__", str(o))), file=answers, flush=True)
"""


class ClientProcess:
    """A Python client (`Client.connect`) to the cluster's service in a program of its own (this test
    process keeps its own Ray session), asked expressions in `c` one at a time; values come back as JSON."""

    def __init__(self, head: dict, home: Path):
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-c", CLIENT_LOOP, head["gcs"], str(write_end)],
                                        env=client_env(head, home), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, text=True, cwd=REPO, pass_fds=(write_end,))
        os.close(write_end)
        self.answers = os.fdopen(read_end)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.answers], daemon=True).start()
        self._expect("READY", 300)

    def _expect(self, prefix: str, timeout: float) -> str:
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"the client program gave no {prefix} within {timeout:.0f}s "
                                     f"(exit code {self.process.poll()})") from None
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def __call__(self, expression: str, setup: str = "") -> object:
        self.process.stdin.write(json.dumps({"expression": expression, "setup": setup}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._expect("RESULT", 300))
        assert "error" not in answer, f"{expression}: {answer['error']}"
        return answer["value"]

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        self.answers.close()
