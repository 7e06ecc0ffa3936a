"""The error a client of the service raises when the service refuses a request or cannot be reached."""

from __future__ import annotations


class ServiceError(RuntimeError):
    """The service refused a request or is not reachable."""


class ClusterRefused(ServiceError):
    """A Ray cluster answers at the address and refuses this process (its token authentication): a cluster is
    there, so nothing answers in its service's place."""
