"""A private Ray cluster for `Client.local` (the demo, `aspen run`, benchmarks): started on the machine that
trains, and stopped with the client. Ray's daemons share that machine's cores with the trainer's torch
threads, and on a CPU node every slice they take stalls a whole step (see `actors/niceness.py`), so a
private cluster leaves out the periodic work it has no use for:

- no log monitor: it tails every worker's log files to stream them to drivers, and our drivers do not
  take worker logs (`log_to_driver=False`); the files stay where Ray writes them;
- no autoscaler monitor: a private cluster is one node that never scales;
- the raylet's out-of-memory watch reads every worker's /proc/PID/smaps_rollup once a second instead of
  four times (`RAY_memory_monitor_refresh_ms`, unless set): on an idle 2-core cluster that halved the
  raylet's own CPU time (0.65% of a core to 0.35%), and a trainer's memory map is bigger still.

Measured on 2 cores with an idle private cluster (`.ci`-class machine): Ray's processes took 4.3% of a core
before, 3.1% after. A cluster of `ray start` (`aspen serve`) is left as its operator started it."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

log = logging.getLogger(__name__)

QUIET_SETTINGS = {"RAY_memory_monitor_refresh_ms": "1000"}


def start_private_cluster(**init_kwargs: Any) -> None:
    """`ray.init(address="local")` with the settings above (each environment variable only where unset)."""
    for name, value in QUIET_SETTINGS.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", **init_kwargs)
    stop_unused_daemons()


def stop_unused_daemons() -> None:
    """Stop the log monitor and the autoscaler monitor of the cluster this process started. Uses Ray's node
    object (Ray is pinned in pyproject.toml); where it is not there, the daemons keep running: slower, not
    wrong."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        log.warning("not a head node this process started; Ray's log monitor and autoscaler monitor keep running")
        return
    for stop in (node.kill_log_monitor, node.kill_monitor):
        try:
            stop(check_alive=False)
        except Exception as error:  # noqa: BLE001 - the cluster works with them; say why and go on
            log.warning("could not stop %s: %s", stop.__name__, error)
