"""Does the Ray cluster require Ray's token authentication? `aspen serve` asks before it starts the service.

Ray 2.60's `ray start --head` turns token authentication on only where `~/.ray/auth_token` already exists;
on a fresh machine it starts the cluster open (with a warning in its log), and anyone who reaches its ports
can run code on it. What the *client* process believes says nothing about that (its own `RAY_AUTH_MODE`),
so the check asks the cluster: a zero-CPU task, run by one of the cluster's own worker processes, reports

- whether the cluster's GCS answers a request that carries no token (a plain gRPC `GetClusterId` with no
  authentication metadata): refused with UNAUTHENTICATED means token authentication is on, answered means
  it is off;
- the authentication mode of that worker process (`ray._raylet.get_authentication_mode()`, inherited from
  the `ray start` that started its node), which decides where the GCS probe is inconclusive (e.g. a cluster
  that speaks TLS).

    from orchestrator.cluster_auth import require_token_auth
    require_token_auth(insecure=False)     # after ray.init(address=...): raises InsecureClusterError if open
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from orchestrator.errors import ServiceError

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 120.0   # a worker process may take a while to start on a loaded cluster
HOW_TO_TURN_ON = ("stop the cluster, run `ray get-auth-token --generate`, then `ray start --head` (every node and "
                  "client needs the same token: copy ~/.ray/auth_token or set RAY_AUTH_TOKEN, and RAY_AUTH_MODE=token "
                  "on clients)")


class InsecureClusterError(ServiceError):
    """The Ray cluster runs without token authentication and the operator did not pass --insecure."""


@dataclass(frozen=True)
class ClusterAuth:
    """What one of the cluster's worker processes reported."""

    gcs_address: str
    worker_mode: str           # "token" or "disabled": the worker's own authentication mode
    gcs_without_token: str     # "refused", "answered", or "unknown (<why>)"

    @property
    def token_auth(self) -> bool:
        if self.gcs_without_token == "refused":
            return True
        if self.gcs_without_token == "answered":
            return False
        return self.worker_mode == "token"


def _report_task() -> Callable[..., Any]:
    """The probe as a Ray task. Defined inside this function so that Ray ships it by value: the worker
    running it needs only Ray (not this module, nor the same aspen version as this client)."""

    def report(gcs_address: str, rpc_timeout_s: float) -> dict[str, str]:
        import grpc
        from ray._raylet import AuthenticationMode, get_authentication_mode
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        mode = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
        channel = grpc.insecure_channel(gcs_address)   # no interceptor: the request carries no token
        try:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=rpc_timeout_s)
            without_token = "answered"
        except grpc.RpcError as error:
            code = error.code()
            without_token = ("refused" if code == grpc.StatusCode.UNAUTHENTICATED
                             else f"unknown ({code.name if code else 'no status'}: {error.details()})")
        finally:
            channel.close()
        return {"worker_mode": mode, "gcs_without_token": without_token}

    return ray.remote(num_cpus=0, max_retries=1)(report)


def cluster_auth(timeout: float = CHECK_TIMEOUT_S) -> ClusterAuth:
    """Ask the Ray cluster this process is connected to (`ray.init` first) how it authenticates.
    Raises ServiceError where the probe cannot run or does not finish within `timeout` seconds."""
    if not ray.is_initialized():
        raise RuntimeError("cluster_auth() needs a Ray connection: call ray.init(address=...) first")
    gcs_address = ray.get_runtime_context().gcs_address
    try:
        reply = ray.get(_report_task().remote(gcs_address, min(10.0, timeout)), timeout=timeout)
    except GetTimeoutError:
        raise ServiceError(f"could not check whether the Ray cluster at {gcs_address} requires token "
                           f"authentication: a zero-CPU task did not finish within {timeout:.0f}s (is the cluster "
                           "out of worker processes or overloaded?); try again") from None
    except RayError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ServiceError(f"could not check whether the Ray cluster at {gcs_address} requires token "
                           f"authentication: the check's task failed ({lines[-1] if lines else type(error).__name__})"
                           ) from None
    result = ClusterAuth(gcs_address=gcs_address, **reply)
    logger.info("Ray cluster at %s: worker auth mode %s, GCS request without a token %s", gcs_address,
                result.worker_mode, result.gcs_without_token)
    return result


def exposed_token_file(path: Path | None = None) -> str | None:
    """A warning where this machine's Ray token (`~/.ray/auth_token`) can be read by other local users (Ray writes it
    0644 under the usual umask): whoever reads it can run code on the cluster. None where it is private or absent."""
    path = path or Path.home() / ".ray" / "auth_token"
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    return (f"{path} is readable by other users of this machine (mode {stat.S_IMODE(mode):o}): anyone who reads it "
            f"can run code on the cluster; make it private: chmod 600 {path}")


def cluster_uses_token_auth(timeout: float = CHECK_TIMEOUT_S) -> bool:
    """True where the connected Ray cluster requires Ray's authentication token."""
    return cluster_auth(timeout).token_auth


def require_token_auth(insecure: bool = False, timeout: float = CHECK_TIMEOUT_S) -> None:
    """Raise InsecureClusterError, saying how to turn token authentication on, where the connected Ray
    cluster runs without it; `insecure=True` (`aspen serve --insecure`) skips the check."""
    if insecure:
        logger.warning("--insecure: not checking whether the Ray cluster requires token authentication")
        return
    auth = cluster_auth(timeout)
    if not auth.token_auth:
        raise InsecureClusterError(
            f"the Ray cluster at {auth.gcs_address} runs without token authentication (anyone who reaches its "
            f"ports can run code on it); turn it on: {HOW_TO_TURN_ON}; or pass --insecure (insecure=True in "
            "Python) to serve on it anyway")
