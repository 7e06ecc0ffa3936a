"""The Ray cluster under the client: the one at an address, checked to answer before Ray is asked to join
it, or a private local one started in this process (`ensure_ray`); and the actor options that keep the
scheduler on the cluster's head node."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ray

from actors.service.scheduler.config import NAMESPACE
from orchestrator.errors import ClusterRefused, ServiceError
from orchestrator.private_ray import start_private_cluster

log = logging.getLogger(__name__)


def _check_reachable(address: str) -> str:
    """Fail fast, with the address and the fix, where no Ray cluster answers (ray.init would wait for
    minutes), or where one answers and refuses this process's token (ray.init asks again every second for 20
    attempts, each slower on a loaded machine: a CLI command took 22 s to say so, and minutes under a test
    suite's load). Ray client addresses (ray://) are left to Ray. The cluster's address (host:port: `auto`
    resolved, `_auto_found`)."""
    if address.startswith("ray://"):
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        target = canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as error:
        raise ServiceError(f"no running Ray cluster found ({error}); start one with `ray start --head` (see the "
                           "README's cluster set-up) or pass --address / set RAY_ADDRESS") from None
    except ValueError as error:
        raise ValueError(f"--address {address!r}: {error}; give host:port, e.g. 127.0.0.1:6379") from None
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except OSError as error:
        shown = address if target == address else f"{address} ({target})"
        raise ServiceError(f"no Ray cluster answers at {shown}: {error.strerror or error}; check --address / "
                           "RAY_ADDRESS, or start the cluster with `ray start --head`") from None
    from ray._raylet import GcsClient  # one request for the cluster's id: refused at once for a wrong token
    from ray.exceptions import AuthenticationError, RayError

    try:
        GcsClient(address=target)
    except AuthenticationError as error:
        raise ConnectionError(f"Failed to connect to Ray cluster at {target}") from error
    except (RayError, OSError) as error:   # anything else (the GCS restarting): ray.init's own retries decide
        log.debug("the cluster at %s did not give its id at once (%r); ray.init tries again", target, error)
    if address == "auto":
        _auto_found(target)
    return target


def _auto_found(target: str) -> None:
    """`--address auto` found the cluster at `target` on this machine: refused where another user started it (on a
    shared machine Ray's search takes anyone's), else used and said so on stderr: which cluster, who started it."""
    from orchestrator.found_cluster import found_cluster

    found = found_cluster(target)
    if found.foreign():
        raise ServiceError(f"--address auto (the default) found only {found.describe()}, not by you: another "
                           "user's cluster is not joined by guess. Name your own cluster: --address host:port or "
                           "RAY_ADDRESS (start one with `ray start --head --port PORT`), or give this address "
                           "explicitly if you mean to use that cluster")
    print(f"aspen: using {found.describe()} (found by --address auto; name another with --address)",
          file=sys.stderr, flush=True)


def _refusal_fix() -> str:
    """What to do about a cluster that refused this process, by what this process has: a token it does not send
    (no RAY_AUTH_MODE=token), one it sends and that is not the cluster's, or none."""
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or (Path.home() / ".ray" / "auth_token").is_file()
    sends = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    if has_token and not sends:
        return ("this process has a token (~/.ray/auth_token or RAY_AUTH_TOKEN) but does not send it: set "
                "RAY_AUTH_MODE=token (export it, as for every client of the cluster); else name your cluster "
                "with --address or RAY_ADDRESS")
    if has_token:
        return ("the cluster refused this process's token (~/.ray/auth_token or RAY_AUTH_TOKEN): it is another "
                "cluster's; use the head's (copy its ~/.ray/auth_token or set RAY_AUTH_TOKEN), or name your "
                "cluster with --address or RAY_ADDRESS")
    return ("if it is your service's cluster and uses token authentication, this process needs its token (copy "
            "the head's ~/.ray/auth_token or set RAY_AUTH_TOKEN) and RAY_AUTH_MODE=token; else name yours with "
            "--address or RAY_ADDRESS")


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> None:
    """Connect to the Ray cluster at `address` (or $RAY_ADDRESS); without either, start a private local
    one (no dashboard: its processes would take CPU from training on small machines)."""
    if ray.is_initialized():
        return
    # Ray's "Connecting to existing Ray cluster" / "Started a local Ray instance" lines only where this process
    # logs at INFO (`aspen -v`, `--debug`); its warnings always
    init_kwargs.setdefault("logging_level", logging.INFO if logging.getLogger().isEnabledFor(logging.INFO)
                           else logging.WARNING)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:   # `auto` resolved once, here: ray.init's own search could find another cluster by then
            address = _check_reachable(address)
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **init_kwargs)
        except ConnectionError as error:   # a cluster answers and refuses this process: another's token, not Ray
            cause = str(error.__cause__ or "").split(". ")[0]
            raise ClusterRefused(f"{error}{f' ({cause})' if cause else ''}; {_refusal_fix()}") from None
        return
    init_kwargs.setdefault("include_dashboard", False)
    start_private_cluster(namespace=NAMESPACE, log_to_driver=False, **init_kwargs)


def _on_head_node() -> dict[str, Any]:
    """Actor options that keep the scheduler on the cluster's head node, next to its job table: a worker
    node may leave the cluster at any time, the head lives as long as the cluster does (and a scheduler
    restarted after its process died comes back there, to the same table)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.ray_trainers import head_node_id

    head = head_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)} if head else {}
