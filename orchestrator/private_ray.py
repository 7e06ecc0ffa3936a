"""A private Ray cluster for `Client.local` (the demo, `aspen run`, benchmarks): started on the machine that
trains, and stopped with the client. Ray's daemons share that machine's cores with the trainer's torch
threads, and on a CPU node every slice they take stalls a whole step (see `actors/niceness.py`), so a
private cluster leaves out the periodic work it has no use for:

- no log monitor: it tails every worker's log files to stream them to drivers, and our drivers do not
  take worker logs (`log_to_driver=False`); the files stay where Ray writes them;
- no autoscaler monitor: a private cluster is one node that never scales; the cluster says so in its GCS's
  key-value store (`NO_AUTOSCALER_KEY`), so that its service does not wait for an autoscaler to report
  (`actors/ray_trainers.py`'s AUTOSCALER_GRACE_S): a trainer no node holds is said without that wait;
- the raylet's out-of-memory watch reads every worker's /proc/PID/smaps_rollup once a second instead of
  four times (`RAY_memory_monitor_refresh_ms`): on an idle 2-core cluster that halved the raylet's own CPU
  time (0.65% of a core to 0.35%), and a trainer's memory map is bigger still;
- no dashboard head (`include_dashboard=False` only trims its modules; the process still runs): nothing
  queries a private cluster's REST API, Ray's state API or its job server;
- no bookkeeping that only the dashboard and the state API read: task events (each worker sent its tasks'
  state changes to GCS every second), Ray's own metrics (recorded on every RPC and task in every process;
  the service's metrics are its own exporter, `orchestrator/metrics.py`), per-handler timing statistics in
  every Ray event loop, and the dashboard agent's node report (psutil over every process every 5 s; now a
  minute).

Its workers start at nice 0 (`RAY_worker_niceness`; Ray's default is 15): a trainer's OpenMP threads at 15
lose every contest with Ray's own processes, each lost slice stalling a whole parallel region (measured:
10-15% slower steps on 2 cores), and the scheduler and job actors set their own lower priority
(`actors/niceness.py`), but come down from 15 only with CAP_SYS_NICE: elsewhere the scheduler got a third
of the CPU share it is meant to have (nice 15 against 10) beside busy trainers and fell behind their steps.

Measured on 2 cores with an idle private cluster (`.ci`-class machine): Ray's processes took 4.3% of a core
before the first three, 3.1% after. During the training of the demo's 4 jobs, every process but the trainer
took 6.1% of a core (894 wake-ups a second) before the last two, 4.3-4.9% (734-767) after, in two runs.

Each setting is applied only where the caller's environment does not set it, for the processes `ray.init`
starts (they keep it; Ray's workers inherit the raylet's environment), and taken out of this process's
environment again afterwards, so that programs it starts later see the environment they were given. A
cluster of `ray start` (`aspen serve`) is left as its operator started it."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

log = logging.getLogger(__name__)

QUIET_SETTINGS = {
    "RAY_worker_niceness": "0",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_task_events_report_interval_ms": "0",   # 0: no task events recorded or sent (Ray's own meaning)
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",      # the dashboard agent's node report (read by its Python)
}


TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def _own_cluster_token_notice(record: logging.LogRecord) -> bool:
    """False (dropped) for Ray's notice that the new local cluster uses token authentication."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_private_cluster(**init_kwargs: Any) -> None:
    """`ray.init(address="local")` with the settings above (each environment variable only where unset)."""
    added = {name: value for name, value in QUIET_SETTINGS.items() if name not in os.environ}
    os.environ.update(added)
    # a new local cluster takes token authentication (Ray's default for `ray.init()`), and Ray says so on every
    # run, naming how to turn it off: not the user's business for a cluster of this process's own
    notice = logging.getLogger(TOKEN_NOTICE_LOGGER)
    notice.addFilter(_own_cluster_token_notice)
    try:
        ray.init(address="local", **init_kwargs)
    finally:
        notice.removeFilter(_own_cluster_token_notice)
        for name in added:
            os.environ.pop(name, None)
    stop_unused_daemons()
    mark_no_autoscaler()


def mark_no_autoscaler() -> None:
    """Write in the GCS of the cluster this process started that no autoscaler runs there (read by `ask_gcs`)."""
    from ray.experimental.internal_kv import _internal_kv_put

    from actors.ray_trainers import NO_AUTOSCALER_KEY, NO_AUTOSCALER_NAMESPACE

    _internal_kv_put(NO_AUTOSCALER_KEY, b"1", namespace=NO_AUTOSCALER_NAMESPACE)


def stop_unused_daemons() -> None:
    """Stop the log monitor, the autoscaler monitor and the dashboard head of the cluster this process
    started. Uses Ray's node object (Ray is pinned in pyproject.toml); where it is not there, the daemons keep
    running: slower, not wrong."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        log.warning("not a head node this process started; Ray's log monitor, autoscaler monitor and dashboard "
                    "keep running")
        return
    for stop in (node.kill_log_monitor, node.kill_monitor, node.kill_dashboard):
        try:
            stop(check_alive=False)
        except Exception as error:  # noqa: BLE001 - the cluster works with them; say why and go on
            log.warning("could not stop %s: %s", stop.__name__, error)
