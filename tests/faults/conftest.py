"""Fixtures of the fault-injection suite."""

from tests.helpers.disks import small_disks  # noqa: F401  (a fixture)
