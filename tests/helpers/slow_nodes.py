"""A scheduler actor whose reads of the cluster's nodes (`ray.nodes()`, a call to Ray's GCS) wait while a gate file
exists, as on a cluster whose GCS is slow to answer: `hang_node_reads`, given as its listeners factory
(`SchedulerActor(config, "tests.helpers.slow_nodes:hang_node_reads")`, called as it starts)."""

from __future__ import annotations

import os
import time


def hang_node_reads(config) -> list:
    """No listeners; `ray.nodes()` in this process waits while the file `<state_dir>/../gate` exists."""
    import ray

    gate, real = os.path.join(os.path.dirname(os.path.abspath(config.state_dir)), "gate"), ray.nodes

    def nodes():
        while os.path.exists(gate):
            time.sleep(0.05)
        return real()

    ray.nodes = nodes
    return []
